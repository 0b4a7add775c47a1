"""MTP head training by self-distillation: objective, optimiser, evaluation, checkpoints, export.

Objective (DeepSeek-V3 MTP, arXiv 2412.19437, its multi-token prediction section; EAGLE, arXiv
2401.15077): MTP row ``p`` sees the target's post-norm hidden state ``h_p`` and the token
``x_{p+1}`` and predicts ``x_{p+2}`` through the target's frozen LM head:

* ``CE``: cross-entropy against the data token ``x_{p+2}`` (the target's own generation);
* optional ``KL(p_target(. | h_{p+1}) || p_mtp)``, the target's distribution for the same token
  (weight ``kl_weight``);
* optional recursive passes (``num_passes > 1``): the same layer re-run as draft substeps, fed its
  own output hidden state, under the exact attention context of inference (see
  :mod:`jmtp.train.dense`); pass ``i >= 2`` losses are weighted by ``recursive_weight``.

Only ``params["mtp"]`` is trained (kept in fp32); embedding, final norm, LM head and the target
layers are frozen (the target layers are not even needed: their hidden states are cached).

The head is an :class:`~jmtp.model.modules.MTPHead` (Flax NNX) optimised by an
``nnx.Optimizer(head, tx, wrt=nnx.Param)`` with the optax chain of :func:`make_optimizer`; both
sit in an :class:`MTPTrainModel`, split once (``nnx.split``) into a static graph definition and
the pure ``nnx.State`` that :func:`train_step` takes and returns (merged inside ``jax.jit``, as
the engine's step does). The loss runs the pure functions on ``head.to_params()``.

Optional FR-Spec draft vocabulary (Zhao et al. 2025, arXiv 2502.14856): with
``draft_vocab_size = N`` the loss and the draft's predictions use only the N most frequent tokens
of the training responses, which cuts the dominant LM-head cost of a small model's training step.

Evaluation (on prompts never trained on): with greedy target responses, a draft is accepted iff it
equals the target's argmax. ``acc1`` = first-draft acceptance = top-1 agreement of pass-1 with the
target argmax ``argmax compute_logits(h_{p+1})``; ``acc1_label`` = top-1 agreement with the data token;
``chain_k`` = fraction of start rows whose first ``k`` drafts are all accepted (pass ``i`` run at row
``r+i-1``); ``al_K = 1 + sum_{k<=K} chain_k`` estimates the mean acceptance length (tokens per verify
step) at ``K`` drafts.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jmtp.model.config import ModelConfig
from jmtp.model.modules import MTPHead
from jmtp.model.mtp_head import (HEAD_FORMAT, export_mtp_head, head_metadata, load_draft_vocab,
                                 load_mtp_head, save_token_freq)
from jmtp.model.params import init_mtp_params
from jmtp.train.data import MTPData, make_batch, pack_rows
from jmtp.train.dense import check_trainable, dense_mtp_forward

log = logging.getLogger(__name__)

HEAD_FILE = "mtp_head.safetensors"
FREQ_FILE = "token_freq.safetensors"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"

# Fields that may change between an interrupted run and its resumption.
_RESUME_FREE = ("eval_every", "ckpt_every", "keep_checkpoints", "progress")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (saved as ``config.json`` beside the weights).

    Attributes:
      steps: optimiser steps in total (the schedule's length).
      batch_size: packed rows per step B.
      seq_len: MTP rows per packed row W (longer sequences are cut into chunks of W).
      lr: peak learning rate; warm-up from 0 over ``warmup_steps``, cosine to ``lr * min_lr_ratio``.
      warmup_steps: linear warm-up steps (must be < steps).
      min_lr_ratio: final learning rate / peak.
      weight_decay: AdamW decoupled weight decay (Loshchilov & Hutter 2019), matrices only.
      b1, b2: Adam moments.
      grad_clip: global-norm gradient clipping threshold.
      seed: seeds data order and the feature-noise rng.
      num_passes: recursive passes trained (1 = plain MTP objective).
      recursive_weight: loss weight of passes >= 2.
      kl_weight: weight of KL(target || mtp) added to the cross-entropy (0 = off).
      feature_noise: std of Gaussian noise added to the target hidden state (EAGLE-style robustness;
        0 = off).
      draft_vocab_size: 0 = full vocabulary; N = FR-Spec top-N training vocabulary.
      labels: ``"data"`` (the generated token x_{p+2}) or ``"target"`` (the target's own greedy
        prediction of x_{p+2}, ``MTPData.top1``; what greedy verification accepts).
      prompt_rows: also train on rows inside the prompt (with ``labels="target"``).
      eval_every: steps between evaluations; eval_passes: drafts evaluated (K up to this).
      ckpt_every: steps between orbax checkpoints; keep_checkpoints: how many to keep.
      layer_idx: which MTP module to train.
      progress: show a tqdm bar.
    """

    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    num_passes: int = 1
    recursive_weight: float = 0.5
    kl_weight: float = 0.0
    feature_noise: float = 0.0
    draft_vocab_size: int = 0
    labels: str = "data"
    prompt_rows: bool = False
    eval_every: int = 50
    eval_passes: int = 3
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    layer_idx: int = 0
    progress: bool = True

    def __post_init__(self):
        pos = ("steps", "batch_size", "num_passes", "eval_every", "eval_passes", "ckpt_every",
               "keep_checkpoints")
        for name in pos:
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"TrainConfig.seq_len must be >= 2, got {self.seq_len}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"TrainConfig.warmup_steps must lie in [0, steps={self.steps}), got {self.warmup_steps}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        for name in ("min_lr_ratio", "weight_decay", "recursive_weight", "kl_weight", "feature_noise",
                     "draft_vocab_size", "layer_idx"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.labels not in ("data", "target"):
            raise ValueError(f"TrainConfig.labels must be 'data' or 'target', got {self.labels!r}")
        if not self.grad_clip > 0:
            raise ValueError(f"TrainConfig.grad_clip must be > 0, got {self.grad_clip}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------
# Loss and evaluation (pure functions of the MTP params).


def _head_weight(params: dict) -> jax.Array:
    """The frozen LM head as ``f[H, V]`` (``embed.T`` when tied), as :func:`compute_logits` uses it."""
    return params["lm_head"] if "lm_head" in params else params["embed"].T


def _forward(cfg, tcfg, mtp, frozen, batch, num_passes, noise_key=None):
    params = dict(frozen, mtp=mtp)
    hidden = batch["hidden"]
    if noise_key is not None and tcfg.feature_noise > 0:
        hidden = hidden + tcfg.feature_noise * jax.random.normal(noise_key, hidden.shape, hidden.dtype)
    return dense_mtp_forward(cfg, params, batch["ids"], hidden, batch["positions"],
                             batch["segment_ids"], num_passes, tcfg.layer_idx)


def _logits(h, head_w):
    return jnp.dot(h, head_w, preferred_element_type=jnp.float32).astype(jnp.float32)


def loss_fn(mtp, frozen, head_w, label_map, batch, noise_key, *, cfg: ModelConfig, tcfg: TrainConfig):
    """Scalar loss and metrics of one batch (see module docstring).

    ``head_w f[H, V']`` is the (possibly FR-Spec restricted) frozen LM head; ``label_map i32[V]``
    maps full ids to columns of ``head_w`` (-1 = outside the draft vocabulary: no loss).
    """
    outs = _forward(cfg, tcfg, mtp, frozen, batch, tcfg.num_passes, noise_key)
    labels = label_map[batch["labels"]]
    mask = batch["loss_mask"] * (labels >= 0)
    labels = jnp.maximum(labels, 0)
    t_logp = None
    if tcfg.kl_weight > 0:
        t_logp = jax.nn.log_softmax(_logits(batch["target_hidden"], head_w), axis=-1)
        t_logp = jax.lax.stop_gradient(t_logp)
    total, metrics = 0.0, {}
    for i, (h, _, valid) in enumerate(outs):
        logp = jax.nn.log_softmax(_logits(h, head_w), axis=-1)              # f32[B, W, V']
        m = mask * valid
        denom = jnp.maximum(m.sum(), 1.0)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        ce = (nll * m).sum() / denom
        term = ce
        if t_logp is not None:
            kl = (jnp.exp(t_logp) * (t_logp - logp)).sum(-1)
            term = term + tcfg.kl_weight * (kl * m).sum() / denom
        total = total + (1.0 if i == 0 else tcfg.recursive_weight) * term
        metrics[f"ce{i + 1}"] = ce
        metrics[f"acc{i + 1}_train"] = ((logp.argmax(-1) == labels) * m).sum() / denom
    metrics["loss"] = total
    return total, metrics


def eval_batch(mtp, frozen, head_w, full_head_w, draft_ids, batch, *, cfg: ModelConfig,
               tcfg: TrainConfig):
    """Per-row eval arrays of one batch: for each pass ``i`` a pair ``bool[B,W]`` (draft == target
    argmax, draft == data label) and ``valid_i bool[B,W]``; plus ``loss_mask`` and the pass-1 CE."""
    outs = _forward(cfg, tcfg, mtp, frozen, batch, tcfg.eval_passes)
    target_arg = _logits(batch["target_hidden"], full_head_w).argmax(-1)
    res = {"mask": batch["loss_mask"] > 0}
    for i, (h, _, valid) in enumerate(outs):
        logits = _logits(h, head_w)
        pred = draft_ids[logits.argmax(-1)]
        res[f"greedy{i + 1}"] = pred == target_arg
        res[f"label{i + 1}"] = pred == batch["labels"]
        res[f"valid{i + 1}"] = valid
        if i == 0:
            full_logp = jax.nn.log_softmax(_logits(h, full_head_w), axis=-1)
            nll = -jnp.take_along_axis(full_logp, batch["labels"][..., None], axis=-1)[..., 0]
            res["nll_sum"] = (nll * batch["loss_mask"]).sum()
    return res


def summarize_eval(parts: list[dict], passes: int) -> dict:
    """Acceptance statistics from :func:`eval_batch` outputs (host side, numpy)."""
    cat = {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0] if k != "nll_sum"}
    mask = cat["mask"]
    n = max(int(mask.sum()), 1)
    out = {"eval_rows": int(mask.sum()),
           "eval_ce": float(sum(float(p["nll_sum"]) for p in parts) / n)}
    for i in range(1, passes + 1):
        ok = mask & cat[f"valid{i}"]
        den = max(int(ok.sum()), 1)
        out[f"acc{i}"] = float((cat[f"greedy{i}"] & ok).sum() / den)
        out[f"acc{i}_label"] = float((cat[f"label{i}"] & ok).sum() / den)
    # Chains: start row r accepted k deep iff pass i (1..k) at row r+i-1 is right.
    w = mask.shape[1]
    for kind, suffix in (("greedy", ""), ("label", "_label")):
        alive = np.ones_like(mask)
        exists = np.ones_like(mask)
        al = 1.0
        for k in range(1, passes + 1):
            sh = k - 1
            corr = np.zeros_like(mask)
            ok = np.zeros_like(mask)
            corr[:, :w - sh] = cat[f"{kind}{k}"][:, sh:]
            ok[:, :w - sh] = (mask & cat[f"valid{k}"])[:, sh:]
            alive = alive & corr
            exists = exists & ok
            chain = float((alive & exists).sum() / max(exists.sum(), 1))
            al += chain
            out[f"chain{k}{suffix}"] = chain
            out[f"al{k}{suffix}"] = al
    return out


def decay_mask(tree):
    """AdamW weight-decay mask of :func:`make_optimizer`: True for the matrices (``eh_proj``,
    ``layer.wq/wk/wv/wo/w_gate/w_up/w_down``: ``ndim >= 3`` with the leading ``layers`` axis),
    False for norms and biases.

    ``tree`` is the head's parameters as optax sees them: a dict, or the ``nnx.State`` of an
    :class:`MTPHead` (``nnx.Param`` leaves at ``init``, arrays at ``update``; ``tree_map`` reaches
    the array inside each Param, so the mask has the tree's own structure)."""
    return jax.tree_util.tree_map(lambda a: a.ndim >= 3, tree)


@functools.lru_cache(maxsize=None)
def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping + AdamW (decay on matrices only, :func:`decay_mask`) with linear
    warm-up and cosine decay.

    One object per ``tcfg`` (cached): the transformation is static data of the optimizer's graph
    definition, so trainers with equal configs share :func:`train_step`'s compiled programs."""
    sched = optax.warmup_cosine_decay_schedule(
        0.0, tcfg.lr, tcfg.warmup_steps, tcfg.steps, tcfg.lr * tcfg.min_lr_ratio)
    return optax.chain(
        optax.clip_by_global_norm(tcfg.grad_clip),
        optax.adamw(sched, b1=tcfg.b1, b2=tcfg.b2, weight_decay=tcfg.weight_decay, mask=decay_mask))


def learning_rate(tcfg: TrainConfig, step):
    """The schedule of :func:`make_optimizer` at ``step`` (0-based)."""
    return optax.warmup_cosine_decay_schedule(
        0.0, tcfg.lr, tcfg.warmup_steps, tcfg.steps, tcfg.lr * tcfg.min_lr_ratio)(step)


class TrainRng(nnx.Variable):
    """The training run's random key data (``u32[2]``, feature noise); not an ``nnx.Param``, so
    the optimizer leaves it alone."""


class MTPTrainModel(nnx.Module):
    """Everything one training run updates, as one NNX graph.

    Attributes:
      mtp: the :class:`MTPHead` being trained (fp32 Params with their logical axes).
      opt: ``nnx.Optimizer(mtp, tx, wrt=nnx.Param)``: ``opt.step u32[]`` (optimiser steps taken)
        and ``opt.opt_state`` (optax's state of ``tx``, moments shaped like the head's Params).
      rng: :class:`TrainRng` key data ``u32[2]`` of the feature-noise stream.

    ``nnx.split`` gives the graph definition (static: also holds ``tx``) and the pure state with
    entries ``"mtp"``, ``"opt"``, ``"rng"`` that :func:`train_step` takes and returns.
    """

    def __init__(self, head: MTPHead, tx: optax.GradientTransformation, seed: int):
        self.mtp = head
        self.opt = nnx.Optimizer(head, tx, wrt=nnx.Param)
        self.rng = TrainRng(jax.random.key_data(jax.random.key(seed)))


def state_step(state: nnx.State) -> int:
    """Optimiser steps taken by the train state ``state`` (its ``opt.step``)."""
    return int(state["opt"]["step"][...])


@functools.partial(jax.jit, static_argnums=0, static_argnames=("cfg", "tcfg"))
def train_step(graphdef: nnx.GraphDef, state: nnx.State, batch, frozen, head_w, label_map, *,
               cfg: ModelConfig, tcfg: TrainConfig):
    """One optimiser step on the pure train state (``graphdef, state = nnx.split(model)`` of an
    :class:`MTPTrainModel`); returns ``(new state, metrics)``.

    Inside the jitted function the state is merged with ``graphdef``, the loss (:func:`loss_fn` on
    ``head.to_params()``) differentiated with respect to the head's Params, and
    ``opt.update(head, grads)`` applies :func:`make_optimizer`'s chain; ``opt.step`` and ``rng``
    advance. ``metrics``: the loss terms of :func:`loss_fn` plus ``grad_norm`` (before clipping)
    and ``lr`` (the schedule at this step), f32 scalars.

    Compiled once per ``(graphdef, cfg, tcfg)`` and shapes (shared by every trainer instance with
    an equal config: :func:`make_optimizer` is cached).
    """
    model = nnx.merge(graphdef, state)
    key = jax.random.wrap_key_data(model.rng[...])
    key, sub = jax.random.split(key)
    noise_key = sub if tcfg.feature_noise > 0 else None

    def objective(head: MTPHead):
        return loss_fn(head.to_params(), frozen, head_w, label_map, batch, noise_key,
                       cfg=cfg, tcfg=tcfg)

    (_, metrics), grads = nnx.value_and_grad(objective, has_aux=True)(model.mtp)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = learning_rate(tcfg, model.opt.step[...].astype(jnp.int32))
    model.opt.update(model.mtp, grads)
    model.rng[...] = jax.random.key_data(key)
    return nnx.state(model), metrics


_eval_batch_jit = jax.jit(eval_batch, static_argnames=("cfg", "tcfg"))


# ------------------------------------------------------------------------------------------------
# Trainer.


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

    Raises:
      ValueError: no trainable rows in ``train_data``, bad ``draft_vocab``, or a resume whose saved
        config or data differ from this run's.
    """

    def __init__(self, cfg: ModelConfig, params: dict, train_data: MTPData,
                 eval_data: MTPData | None, tcfg: TrainConfig, workdir: str,
                 draft_vocab: np.ndarray | None = None, extra_config: dict | None = None):
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
        self._perms: dict[int, np.ndarray] = {}
        self._mgr = None
        self.history: dict[int, float] = {}
        self.last_eval: dict = {}

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
        return {k: jnp.asarray(v) for k, v in
                make_batch(self.train_data, self.batch_rows(step), self.tcfg.seq_len,
                           labels=self.tcfg.labels, prompt_rows=self.tcfg.prompt_rows).items()}

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

    def train(self, callback: Callable[[int, dict], None] | None = None) -> nnx.State:
        """Run (or resume) training up to ``tcfg.steps``; returns the final train state (also
        ``self.state``; :meth:`head` gives its module).

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
