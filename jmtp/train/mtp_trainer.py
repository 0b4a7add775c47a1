"""MTP head training by self-distillation: the trainer (data order, evaluation, checkpoints, export).

Only ``params["mtp"]`` is trained (kept in fp32); embedding, final norm, LM head and the target
layers are frozen (the target layers are not even needed: their hidden states are cached).

:class:`MTPTrainer` drives the parts: hyper-parameters (:class:`~jmtp.train.config.TrainConfig`),
objective and acceptance statistics (:mod:`jmtp.train.objective`), optimiser, train model and
jitted step (:mod:`jmtp.train.step`), packed batches of cached data (:mod:`jmtp.train.data`). It
owns the run's directory: orbax checkpoints, ``config.json``, ``metrics.jsonl`` and the exported
head.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmtp.model.config import ModelConfig
from jmtp.model.modules import MTPHead
from jmtp.model.checkpoints.mtp_head import (HEAD_FORMAT, export_mtp_head, head_metadata, load_draft_vocab,
                                 load_mtp_head, save_token_freq)
from jmtp.model.params import init_mtp_params
from jmtp.train.config import TrainConfig
from jmtp.train.data import MTPData, gather_hidden, make_batch, pack_rows
from jmtp.train.dense import check_trainable
from jmtp.train.objective import eval_batch, summarize_eval
from jmtp.train.step import MTPTrainModel, make_optimizer, state_step, train_step

log = logging.getLogger(__name__)

HEAD_FILE = "mtp_head.safetensors"
FREQ_FILE = "token_freq.safetensors"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"

# Fields that may change between an interrupted run and its resumption.
_RESUME_FREE = ("eval_every", "ckpt_every", "keep_checkpoints", "progress")


def _head_weight(params: dict) -> jax.Array:
    """The frozen LM head as ``f[H, V]`` (``embed.T`` when tied), as
    :func:`jmtp.model.llama.compute_logits` uses it."""
    return params["lm_head"] if "lm_head" in params else params["embed"].T


_eval_batch_jit = jax.jit(eval_batch, static_argnames=("cfg", "tcfg"))


def _data_fingerprint(data: MTPData) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(data.tokens).tobytes())
    h.update(np.ascontiguousarray(data.offsets).tobytes())
    h.update(np.ascontiguousarray(data.prompt_lens).tobytes())
    return h.hexdigest()[:16]


class MTPTrainer:
    """Train ``params["mtp"]`` of a frozen target on cached self-distillation data.

    The head is trained as an :class:`MTPHead` module inside an :class:`MTPTrainModel` (head +
    ``nnx.Optimizer``); the train state that :meth:`train`, :meth:`restore` and
    :meth:`initial_state` return is that model's pure ``nnx.State`` (``state["mtp"]`` the head's
    Params, ``state["opt"]`` the optimizer's step and optax state, ``state["rng"]``), with
    :attr:`graphdef` its static graph definition. :meth:`head` / :meth:`mtp_params` turn a state
    back into a module / the ``params["mtp"]`` dict.

    Args:
      cfg: the target's :class:`ModelConfig`.
      params: target params; ``params["mtp"]`` (if present) is the starting point, else a fresh
        head from :func:`init_mtp_params`. Only ``embed``, ``final_norm`` and ``lm_head`` are used.
      train_data / eval_data: cached data (:class:`MTPData`); eval may be ``None``.
      tcfg: :class:`TrainConfig`.
      workdir: output directory: ``checkpoints/`` (orbax), ``config.json``, ``metrics.jsonl``.
      draft_vocab: ``i32[N]`` ids for the FR-Spec training vocabulary (required iff
        ``tcfg.draft_vocab_size > 0``; N must equal it).
      extra_config: merged into ``config.json`` (model / data description).
      device_data: keep ``train_data.hidden`` on the device and gather each batch's hidden rows
        there (:func:`jmtp.train.data.gather_hidden`) instead of copying ``[B, W, H]`` arrays
        from the host every step (the accelerator path; same batches, same values).

    Raises:
      ValueError: no trainable rows in ``train_data``, bad ``draft_vocab``, or a resume whose saved
        config or data differ from this run's.
    """

    def __init__(self, cfg: ModelConfig, params: dict, train_data: MTPData,
                 eval_data: MTPData | None, tcfg: TrainConfig, workdir: str,
                 draft_vocab: np.ndarray | None = None, extra_config: dict | None = None,
                 device_data: bool = False):
        check_trainable(cfg, "MTPTrainer")
        self.cfg, self.tcfg, self.workdir = cfg, tcfg, os.path.abspath(workdir)
        self.train_data, self.eval_data = train_data, eval_data
        self.frozen = {k: params[k] for k in ("embed", "final_norm", "lm_head") if k in params}
        full_w = _head_weight(params)
        self.full_head_w = full_w
        v = cfg.vocab_size
        if tcfg.draft_vocab_size:
            if draft_vocab is None or len(draft_vocab) != tcfg.draft_vocab_size:
                raise ValueError(
                    f"draft_vocab must hold draft_vocab_size={tcfg.draft_vocab_size} ids")
            dv = np.asarray(draft_vocab, np.int32)
            if dv.min() < 0 or dv.max() >= v or len(np.unique(dv)) != len(dv):
                raise ValueError(f"draft_vocab ids must be distinct and lie in [0, {v})")
            lm = np.full(v, -1, np.int32)
            lm[dv] = np.arange(len(dv), dtype=np.int32)
            self.head_w = jnp.asarray(full_w)[:, jnp.asarray(dv)]
            self.label_map = jnp.asarray(lm)
            self.draft_ids = jnp.asarray(dv)
        else:
            self.head_w = full_w
            self.label_map = jnp.arange(v, dtype=jnp.int32)
            self.draft_ids = jnp.arange(v, dtype=jnp.int32)
        mtp = params.get("mtp")
        if mtp is None:
            mtp = init_mtp_params(cfg, params, jax.random.PRNGKey(tcfg.seed))
        # The starting head as the params["mtp"] dict (fp32): what evaluate() / export() take.
        self.init_mtp = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), mtp)

        if tcfg.labels == "target" and train_data.top1 is None:
            raise ValueError("TrainConfig.labels='target' needs train_data.top1 (target_top1)")
        self.train_rows = pack_rows(train_data, tcfg.seq_len, prompt_rows=tcfg.prompt_rows)
        if not self.train_rows:
            raise ValueError("train_data has no MTP row with a response label to train on")
        self.eval_rows = pack_rows(eval_data, tcfg.seq_len) if eval_data is not None else []

        self.opt = make_optimizer(tcfg)
        # Static graph definitions of the train model and of its head (Params only).
        self.graphdef = nnx.graphdef(self._build_model())
        self.head_graphdef = nnx.graphdef(MTPHead.from_params(cfg, self.init_mtp))
        self.config_record = {
            "train": tcfg.to_dict(),
            "model": {k: (list(v) if isinstance(v, tuple) else v)
                      for k, v in dataclasses.asdict(cfg).items()},
            "data": {"train_sequences": train_data.num_sequences,
                     "train_tokens": int(len(train_data.tokens)),
                     "train_packed_rows": len(self.train_rows),
                     "train_fingerprint": _data_fingerprint(train_data),
                     "eval_sequences": eval_data.num_sequences if eval_data is not None else 0,
                     "eval_packed_rows": len(self.eval_rows)},
        }
        self.config_record.update(extra_config or {})
        self._dev_hidden = jnp.asarray(train_data.hidden) if device_data else None
        self._perms: dict[int, np.ndarray] = {}
        self._mgr = None
        self.history: dict[int, float] = {}
        self.last_eval: dict = {}
        self.stopped_early: int | None = None     # steps done when a deadline stopped training

    # -------------------------------------------------------------- state
    def _build_model(self) -> MTPTrainModel:
        return MTPTrainModel(MTPHead.from_params(self.cfg, self.init_mtp), self.opt, self.tcfg.seed)

    def initial_state(self) -> nnx.State:
        """Fresh train state: the ``nnx.State`` of an :class:`MTPTrainModel` holding the starting
        head (fp32), a fresh optimizer state (``opt.step = 0``) and the seed's key data."""
        return nnx.state(self._build_model())

    def head(self, state: nnx.State) -> MTPHead:
        """The :class:`MTPHead` module of a train state (sharing its arrays)."""
        return nnx.merge(self.graphdef, state).mtp

    def mtp_params(self, mtp) -> dict:
        """``params["mtp"]`` (the dict of :mod:`jmtp.model.llama`, keys sorted) of ``mtp``: a
        train state, its ``state["mtp"]``, an :class:`MTPHead`, or already such a dict.

        Raises:
          TypeError: anything else."""
        if isinstance(mtp, nnx.State):
            if "opt" in mtp:                        # the whole train state
                mtp = mtp["mtp"]
            mtp = nnx.merge(self.head_graphdef, mtp)
        if isinstance(mtp, MTPHead):
            mtp = mtp.to_params()
        if not isinstance(mtp, dict):
            raise TypeError(f"expected a train state, an MTPHead or a dict, got {type(mtp).__name__}")
        return jax.tree_util.tree_map(lambda a: a, mtp)    # sorted keys, as optax/orbax had them

    def batch_rows(self, step: int) -> list:
        """Packed rows of ``step``: epoch-wise permutations seeded by ``(seed, epoch)``."""
        n, b = len(self.train_rows), self.tcfg.batch_size
        rows = []
        for g in range(step * b, step * b + b):
            e = g // n
            if e not in self._perms:
                self._perms = {e: np.random.default_rng([self.tcfg.seed, e]).permutation(n)}
            rows.append(self.train_rows[self._perms[e][g % n]])
        return rows

    def batch(self, step: int) -> dict:
        """The device arrays of step ``step``'s batch (:func:`make_batch` of :meth:`batch_rows`;
        with ``device_data`` the hidden rows are gathered on the device)."""
        dev = self._dev_hidden is not None
        out = {k: jnp.asarray(v) for k, v in
               make_batch(self.train_data, self.batch_rows(step), self.tcfg.seq_len,
                          labels=self.tcfg.labels, prompt_rows=self.tcfg.prompt_rows,
                          with_hidden=not dev).items()}
        if dev:
            out["hidden"], out["target_hidden"] = gather_hidden(self._dev_hidden, out["src"],
                                                                out["segment_ids"])
        return out

    # -------------------------------------------------------------- checkpoints
    @property
    def checkpoint_manager(self):
        if self._mgr is None:
            import orbax.checkpoint as ocp
            self._mgr = ocp.CheckpointManager(
                os.path.join(self.workdir, "checkpoints"),
                options=ocp.CheckpointManagerOptions(max_to_keep=self.tcfg.keep_checkpoints,
                                                     create=True))
        return self._mgr

    def save(self, state: nnx.State) -> None:
        """Write an orbax checkpoint of the train state at its step (blocking): the state as a
        pure nested dict of arrays (``nnx.to_pure_dict``: head, optimizer step and optax state,
        rng)."""
        import orbax.checkpoint as ocp
        mgr = self.checkpoint_manager
        mgr.save(state_step(state), args=ocp.args.StandardSave(nnx.to_pure_dict(state)),
                 force=True)
        mgr.wait_until_finished()

    def restore(self) -> nnx.State:
        """Latest checkpoint of ``workdir`` (as a train state, see :meth:`initial_state`) or a
        fresh state; checks the saved config matches.

        Raises:
          ValueError: the saved ``config.json`` differs from this run in a field that changes the
            training trajectory (named in the message), or the training data differ, or the
            checkpoint does not hold this trainer's state (e.g. one written before the trainer
            kept its head as an NNX module).
        """
        import orbax.checkpoint as ocp
        cfg_path = os.path.join(self.workdir, CONFIG_FILE)
        latest = self.checkpoint_manager.latest_step()
        if latest is None:
            return self.initial_state()
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                old = json.load(f)
            mine = self.config_record
            for k, v in old.get("train", {}).items():
                if k not in _RESUME_FREE and mine["train"].get(k) != v:
                    raise ValueError(
                        f"cannot resume from {self.workdir}: TrainConfig.{k} was {v!r}, "
                        f"now {mine['train'].get(k)!r}")
            if old.get("data", {}).get("train_fingerprint") != mine["data"]["train_fingerprint"]:
                raise ValueError(f"cannot resume from {self.workdir}: the training data differ")
        state = self.initial_state()
        try:
            pure = self.checkpoint_manager.restore(
                latest, args=ocp.args.StandardRestore(nnx.to_pure_dict(state)))
            nnx.replace_by_pure_dict(state, pure)
        except (ValueError, KeyError, TypeError) as e:
            first = (str(e).splitlines() or [""])[0]
            raise ValueError(
                f"cannot resume from {self.workdir}: checkpoint {latest} does not hold this "
                f"trainer's state ({type(e).__name__}: {first}); checkpoints written before the "
                "trainer held an NNX head cannot be resumed") from e
        log.info("resumed from %s at step %d", self.workdir, latest)
        return state

    def _write_config(self, extra: dict | None = None) -> None:
        rec = dict(self.config_record)
        rec.update(extra or {})
        os.makedirs(self.workdir, exist_ok=True)
        with open(os.path.join(self.workdir, CONFIG_FILE), "w") as f:
            json.dump(rec, f, indent=2, default=str)

    # -------------------------------------------------------------- eval / train
    def evaluate(self, mtp, rows: list | None = None) -> dict:
        """Acceptance statistics of ``mtp`` on the eval rows (see :func:`summarize_eval`); ``mtp``
        as for :meth:`mtp_params` (a train state, ``state["mtp"]``, an :class:`MTPHead` or the
        dict)."""
        rows = self.eval_rows if rows is None else rows
        if not rows:
            return {}
        mtp = self.mtp_params(mtp)
        b = self.tcfg.batch_size
        parts = []
        for i in range(0, len(rows), b):
            chunk = list(rows[i:i + b])
            real = len(chunk)
            chunk += [[]] * (b - real)          # fixed shape: pad with empty rows
            batch = make_batch(self.eval_data, chunk, self.tcfg.seq_len)
            # Frozen tensors are jit arguments (not constants baked into the program).
            res = _eval_batch_jit(mtp, self.frozen, self.head_w, self.full_head_w, self.draft_ids,
                                  {k: jnp.asarray(v) for k, v in batch.items()}, cfg=self.cfg,
                                  tcfg=self.tcfg)
            parts.append({k: (np.asarray(v)[:real] if np.ndim(v) else np.asarray(v))
                          for k, v in res.items()})
        return summarize_eval(parts, self.tcfg.eval_passes)

    def train(self, callback: Callable[[int, dict], None] | None = None,
              deadline: float | None = None) -> nnx.State:
        """Run (or resume) training up to ``tcfg.steps``; returns the final train state (also
        ``self.state``; :meth:`head` gives its module).

        ``deadline`` (a ``time.perf_counter()`` value): stop after the step that passes it, with a
        checkpoint, even if fewer than ``tcfg.steps`` ran (a time box; the schedule is cut where
        it stands; :attr:`stopped_early` says so).

        Writes ``config.json`` first, appends one JSON line per step to ``metrics.jsonl`` (step, loss,
        lr, grad norm, wall and process-CPU seconds, eval figures when evaluated; on resume the lines
        of steps after the checkpoint are dropped), and saves an orbax checkpoint every
        ``ckpt_every`` steps and at the end. ``callback(step, metrics)`` runs after each step (an
        exception raised there interrupts training like a crash would: no extra checkpoint).
        ``self.history`` maps step -> loss.
        """
        state = self.restore()
        start = state_step(state)
        self._write_config()
        tc = self.tcfg
        bar = None
        it = range(start, tc.steps)
        if tc.progress:
            from tqdm.auto import tqdm
            bar = tqdm(it, initial=start, total=tc.steps, desc="train-mtp", unit="step")
            it = bar
        metrics_path = os.path.join(self.workdir, METRICS_FILE)
        if os.path.exists(metrics_path):   # drop steps logged after the checkpoint we resume from
            with open(metrics_path) as f:
                keep = [l for l in f if l.strip() and json.loads(l)["step"] < start]
            with open(metrics_path, "w") as f:
                f.writelines(keep)
        t_last, cpu_last = time.perf_counter(), time.process_time()
        for step in it:
            state, m = train_step(self.graphdef, state, self.batch(step), self.frozen,
                                  self.head_w, self.label_map, cfg=self.cfg, tcfg=self.tcfg)
            rec = {"step": step, **{k: float(v) for k, v in m.items()}}
            now, cpu_now = time.perf_counter(), time.process_time()
            rec["sec"], rec["cpu_sec"] = now - t_last, cpu_now - cpu_last
            t_last, cpu_last = now, cpu_now
            self.history[step] = rec["loss"]
            done = step + 1
            if self.eval_rows and (done % tc.eval_every == 0 or done == tc.steps):
                self.last_eval = self.evaluate(state)
                rec.update({f"eval_{k}": v for k, v in self.last_eval.items()})
                t_last, cpu_last = time.perf_counter(), time.process_time()
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if bar is not None:
                post = {"loss": f"{rec['loss']:.3f}"}
                if self.last_eval:
                    post["acc1"] = f"{self.last_eval['acc1']:.3f}"
                    post["al"] = f"{self.last_eval[f'al{tc.eval_passes}']:.2f}"
                bar.set_postfix(post)
            if done % tc.ckpt_every == 0 or done == tc.steps:
                self.save(state)
                t_last, cpu_last = time.perf_counter(), time.process_time()
            if callback is not None:
                callback(step, rec)
            if deadline is not None and done < tc.steps and time.perf_counter() > deadline:
                log.warning("time box reached after step %d of %d: stopping", done, tc.steps)
                self.save(state)
                self.stopped_early = done
                break
        if bar is not None:
            bar.close()
        self.state = state
        return state

    def export(self, state: nnx.State, dtype=jnp.bfloat16, token_freq: tuple | None = None,
               extra: dict | None = None, metadata: dict | None = None) -> str:
        """Write ``mtp_head.safetensors`` (and ``token_freq.safetensors``) into ``workdir`` and the
        final ``config.json`` (with ``extra`` results). Returns the head's path.

        With ``token_freq = (ids i32[V], counts)`` the ranking is also stored in the head file
        (``draft_vocab``) with ``draft_vocab_size = tcfg.draft_vocab_size`` as its default;
        ``metadata`` is added to the head file's string metadata. The file has the tensor names,
        shapes and dtype :func:`export_mtp_head` gives the ``params["mtp"]`` dict."""
        path = os.path.join(self.workdir, HEAD_FILE)
        export_mtp_head(path, self.mtp_params(state), self.cfg, dtype,
                        metadata={"steps": state_step(state), "num_passes": self.tcfg.num_passes,
                                  "labels": self.tcfg.labels, **(metadata or {})},
                        draft_vocab=None if token_freq is None else token_freq[0],
                        draft_vocab_size=self.tcfg.draft_vocab_size if token_freq is not None else 0)
        if token_freq is not None:
            save_token_freq(os.path.join(self.workdir, FREQ_FILE), *token_freq)
        self._write_config(extra)
        return path
