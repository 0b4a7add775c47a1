"""Self-distillation data for MTP training: cached target hidden states and packed batches.

Pipeline steps of this module (prompts and responses come from :mod:`jmtp.train.prompts` and
:mod:`jmtp.train.generation`, as token ids):

* :func:`build_dataset` — run the target once over every prompt+response and cache its post-norm
  hidden states (``f16``) in an :class:`MTPData`, saved as ``.npy`` files, so training epochs never
  re-run the target layers; :func:`target_top1` adds the target's greedy prediction of every token.
* :func:`pack_rows` / :func:`make_batch` — pack sequences into fixed ``[B, W]`` rows for
  :func:`jmtp.train.dense.dense_mtp_forward`.

Row convention (FastDeploy's one-position-shifted MTP cache): for a sequence ``x_0..x_{n-1}`` with
target hidden states ``h_0..h_{n-1}`` (``h_t`` is the state that predicts ``x_{t+1}``), MTP row
``p`` (``0 <= p <= n-2``) is fed ``(h_p, x_{p+1})`` and is trained to predict ``x_{p+2}``; rows
whose label is a prompt token (or absent) carry no loss.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmtp.model.config import ModelConfig
from jmtp.model.forward import forward_hidden
from jmtp.model.llama import compute_logits

log = logging.getLogger(__name__)


@dataclasses.dataclass
class MTPData:
    """Token sequences with the target's cached post-norm hidden states, concatenated.

    Attributes:
      tokens: i32[N]     all sequences (prompt + response) back to back.
      hidden: f16[N, H]  target hidden state of every token (``h_t`` predicts ``tokens[t+1]``).
      offsets: i64[S+1]  sequence ``s`` owns ``[offsets[s], offsets[s+1])``.
      prompt_lens: i32[S] number of prompt tokens at the start of each sequence.
      prompt_ids: list[str] the prompt each sequence answers (for split bookkeeping).
      kinds: list[str]   "greedy" or "sampled".
      top1: i32[N] or None  the target's greedy prediction after each token,
        ``top1[t] = argmax compute_logits(hidden[t])`` (see :func:`target_top1`); the
        self-distillation label of every position, prompt tokens included.
    """

    tokens: np.ndarray
    hidden: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    prompt_ids: list
    kinds: list
    top1: np.ndarray | None = None

    def __post_init__(self):
        s = len(self.prompt_lens)
        if self.offsets.shape != (s + 1,) or self.offsets[0] != 0 or self.offsets[-1] != len(self.tokens):
            raise ValueError(f"offsets must be i64[S+1={s + 1}] from 0 to N={len(self.tokens)}")
        if self.hidden.shape[0] != len(self.tokens):
            raise ValueError(f"hidden has {self.hidden.shape[0]} rows, tokens has {len(self.tokens)}")
        if len(self.prompt_ids) != s or len(self.kinds) != s:
            raise ValueError("prompt_ids and kinds need one entry per sequence")
        if self.top1 is not None and self.top1.shape != self.tokens.shape:
            raise ValueError(f"top1 has shape {self.top1.shape}, tokens {self.tokens.shape}")

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_lens)

    def seq_len(self, s: int) -> int:
        return int(self.offsets[s + 1] - self.offsets[s])

    def subset(self, idx: Sequence[int]) -> "MTPData":
        """A new :class:`MTPData` with sequences ``idx`` (copied)."""
        idx = list(idx)
        parts = [slice(int(self.offsets[i]), int(self.offsets[i + 1])) for i in idx]
        lens = [p.stop - p.start for p in parts]
        return MTPData(
            tokens=np.concatenate([self.tokens[p] for p in parts]) if parts else self.tokens[:0],
            hidden=np.concatenate([self.hidden[p] for p in parts]) if parts else self.hidden[:0],
            offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            prompt_lens=self.prompt_lens[idx].astype(np.int32),
            prompt_ids=[self.prompt_ids[i] for i in idx], kinds=[self.kinds[i] for i in idx],
            top1=(None if self.top1 is None else
                  np.concatenate([self.top1[p] for p in parts]) if parts else self.top1[:0]))

    @classmethod
    def concat(cls, parts: Sequence["MTPData"]) -> "MTPData":
        """The sequences of ``parts`` back to back (copied into memory).

        Raises:
          ValueError: if ``parts`` is empty, hidden sizes differ, or only some parts have ``top1``.
        """
        if not parts:
            raise ValueError("concat needs at least one MTPData")
        if len({p.hidden.shape[1] for p in parts}) != 1:
            raise ValueError(f"hidden sizes differ: {[p.hidden.shape[1] for p in parts]}")
        has_top1 = [p.top1 is not None for p in parts]
        if any(has_top1) and not all(has_top1):
            raise ValueError("either every part or none has top1")
        lens = np.concatenate([np.diff(p.offsets) for p in parts])
        return cls(tokens=np.concatenate([p.tokens for p in parts]),
                   hidden=np.concatenate([np.asarray(p.hidden) for p in parts]),
                   offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                   prompt_lens=np.concatenate([p.prompt_lens for p in parts]).astype(np.int32),
                   prompt_ids=[i for p in parts for i in p.prompt_ids],
                   kinds=[k for p in parts for k in p.kinds],
                   top1=np.concatenate([p.top1 for p in parts]) if all(has_top1) else None)

    def save(self, directory: str) -> None:
        """Write ``tokens.npy hidden.npy offsets.npy prompt_lens.npy [top1.npy] meta.json`` into
        ``directory``."""
        os.makedirs(directory, exist_ok=True)
        for name in ("tokens", "hidden", "offsets", "prompt_lens", "top1"):
            if getattr(self, name) is not None:
                np.save(os.path.join(directory, f"{name}.npy"), getattr(self, name))
        with open(os.path.join(directory, "meta.json"), "w") as f:
            json.dump({"prompt_ids": self.prompt_ids, "kinds": self.kinds}, f)

    @classmethod
    def load(cls, directory: str, mmap: bool = True) -> "MTPData":
        """Inverse of :meth:`save` (hidden states memory-mapped by default)."""
        ld = lambda n, m=None: np.load(os.path.join(directory, f"{n}.npy"), mmap_mode=m)
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
        has_top1 = os.path.exists(os.path.join(directory, "top1.npy"))
        return cls(tokens=ld("tokens"), hidden=ld("hidden", "r" if mmap else None),
                   offsets=ld("offsets"), prompt_lens=ld("prompt_lens"),
                   prompt_ids=meta["prompt_ids"], kinds=meta["kinds"],
                   top1=ld("top1") if has_top1 else None)


@jax.jit
def _argmax_logits(params: dict, h: jax.Array) -> jax.Array:
    return jnp.argmax(compute_logits(params, h.astype(params["embed"].dtype)), axis=-1).astype(jnp.int32)


def target_top1(cfg: ModelConfig, params: dict, hidden: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """The target's greedy next-token prediction ``i32[N]`` from cached post-norm hidden states
    ``f[N, H]`` (``argmax compute_logits(h)``, computed ``chunk`` rows at a time)."""
    n = hidden.shape[0]
    head = {k: params[k] for k in ("embed", "lm_head") if k in params}
    out = np.zeros(n, np.int32)
    for i in range(0, n, chunk):
        rows = np.zeros((chunk, cfg.hidden_size), np.float32)
        m = min(chunk, n - i)
        rows[:m] = hidden[i:i + m]
        out[i:i + m] = np.asarray(_argmax_logits(head, jnp.asarray(rows)))[:m]
    return out


def target_hidden_states(cfg: ModelConfig, params: dict, tokens: Sequence[int],
                         bucket: int = 64) -> np.ndarray:
    """Target post-norm hidden states ``f32[n, H]`` of one sequence (a single causal prefill).

    The ids are padded to a multiple of ``bucket`` (causality keeps the first ``n`` rows exact) so
    that few shapes are compiled.

    Raises:
      ValueError: a target ``jmtp.train`` cannot train a head for
        (:func:`jmtp.train.dense.check_trainable`), before any forward runs.
    """
    from jmtp.train.dense import check_trainable
    check_trainable(cfg, "target_hidden_states")
    n = len(tokens)
    padded = np.zeros(-(-n // bucket) * bucket, np.int32)
    padded[:n] = tokens
    return np.asarray(forward_hidden(cfg, params, padded), np.float32)[:n]


def build_dataset(
    cfg: ModelConfig,
    params: dict,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    prompt_ids: Sequence[str],
    kinds: Sequence[str],
    *,
    hidden_fn: Callable[[Sequence[int]], np.ndarray] | None = None,
    hidden: Sequence[np.ndarray] | None = None,
    progress: bool = False,
) -> MTPData:
    """Cache the target's hidden states of each full sequence as ``f16``.

    Args:
      sequences: prompt + response token ids of each sample.
      hidden_fn: ``tokens -> f[n, H]`` override (default :func:`target_hidden_states`: one
        prefill of the target per sequence).
      hidden: precomputed ``f[n_i, H]`` per sequence (e.g. captured by
        :func:`jmtp.train.generation.generate_tokens` with ``return_hidden=True``); then the
        target is not run.

    Raises:
      ValueError: if the per-sequence lists differ in length or a prompt length is not in ``[1, n]``.
    """
    s = len(sequences)
    if not (len(prompt_lens) == len(prompt_ids) == len(kinds) == s) or (
            hidden is not None and len(hidden) != s):
        raise ValueError(
            "sequences, prompt_lens, prompt_ids, kinds (and hidden) must have equal lengths")
    fn = hidden_fn or functools.partial(target_hidden_states, cfg, params)
    it = range(s)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="target hidden states", unit="seq")
    hid = []
    for i in it:
        if not 1 <= prompt_lens[i] <= len(sequences[i]):
            raise ValueError(f"prompt_lens[{i}]={prompt_lens[i]} must lie in [1, {len(sequences[i])}]")
        h = np.asarray(hidden[i] if hidden is not None else fn(sequences[i]))
        if h.shape != (len(sequences[i]), cfg.hidden_size):
            raise ValueError(f"hidden state of sequence {i} has shape {h.shape}, expected "
                             f"({len(sequences[i])}, {cfg.hidden_size})")
        hid.append(h.astype(np.float16))
    lens = [len(x) for x in sequences]
    return MTPData(
        tokens=np.concatenate([np.asarray(x, np.int32) for x in sequences]) if s else np.zeros(0, np.int32),
        hidden=np.concatenate(hid) if s else np.zeros((0, cfg.hidden_size), np.float16),
        offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        prompt_lens=np.asarray(prompt_lens, np.int32),
        prompt_ids=list(prompt_ids), kinds=list(kinds))


def token_frequencies(data: MTPData, vocab_size: int, responses_only: bool = True
                      ) -> tuple[np.ndarray, np.ndarray]:
    """FR-Spec draft vocabulary table (Zhao et al. 2025, arXiv 2502.14856): token counts of the data.

    Returns:
      ``(ids i32[V], counts i64[V])`` sorted by count, descending (ties: smaller id first); the first
      N ids are the draft vocabulary of size N.
    """
    counts = np.zeros(vocab_size, np.int64)
    for s in range(data.num_sequences):
        lo = int(data.offsets[s]) + (int(data.prompt_lens[s]) if responses_only else 0)
        np.add.at(counts, data.tokens[lo:int(data.offsets[s + 1])], 1)
    ids = np.lexsort((np.arange(vocab_size), -counts)).astype(np.int32)
    return ids, counts[ids]


# ------------------------------------------------------------------------------------------------
# Packing into fixed [B, W] rows.


def pack_rows(data: MTPData, seq_len: int, min_labels: int = 1, prompt_rows: bool = False
              ) -> list[list[tuple[int, int, int]]]:
    """Pack the MTP rows of every sequence into rows of ``seq_len`` (first-fit, in sequence order).

    A sequence of ``n`` tokens has ``n-1`` MTP rows (``p = 0..n-2``); longer spans are cut into
    chunks of ``seq_len`` rows (each chunk attends within itself only). Chunks with fewer than
    ``min_labels`` labelled rows are dropped: response rows only, or every row with
    ``prompt_rows=True`` (target-top-1 labels, see :func:`make_batch`).

    Returns:
      one list per packed row of segments ``(sequence index, first MTP row, number of rows)``.

    Raises:
      ValueError: if ``seq_len < 2``.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    chunks = []
    for s in range(data.num_sequences):
        n_rows = data.seq_len(s) - 1
        pl = int(data.prompt_lens[s])
        for start in range(0, n_rows, seq_len):
            cnt = min(seq_len, n_rows - start)
            # labelled rows p: x_{p+2} exists (p <= n-3) and is a response token (p + 2 >= pl);
            # with prompt_rows every row has the target's top-1 label.
            if prompt_rows:
                lo, hi = start, start + cnt
            else:
                lo, hi = max(start, pl - 2), min(start + cnt, n_rows - 1)
            if hi - lo >= min_labels:
                chunks.append((s, start, cnt))
    # First fit (the lowest-numbered row with room), found in O(log n) with a max-tree over the
    # rows' free space; unopened rows have free space seq_len.
    size = 1
    while size < max(len(chunks), 1):
        size *= 2
    tree = [seq_len] * (2 * size)
    rows: list[list[tuple[int, int, int]]] = []
    for c in chunks:
        i = 1
        while i < size:                       # descend to the leftmost leaf with room
            i = 2 * i if tree[2 * i] >= c[2] else 2 * i + 1
        r = i - size
        if r == len(rows):
            rows.append([])
        rows[r].append(c)
        tree[i] -= c[2]
        i //= 2
        while i:
            tree[i] = max(tree[2 * i], tree[2 * i + 1])
            i //= 2
    return rows


def make_batch(data: MTPData, rows: Sequence[Sequence[tuple[int, int, int]]], seq_len: int,
               labels: str = "data", prompt_rows: bool = False, with_hidden: bool = True
               ) -> dict[str, np.ndarray]:
    """Dense arrays for :func:`jmtp.train.dense.dense_mtp_forward` from packed rows.

    Args:
      labels: ``"data"``: the label of MTP row p is the data token x_{p+2}; ``"target"``: the
        target's greedy prediction ``data.top1[p+1]`` (self-distillation of the target's argmax,
        defined at every row, the last included).
      prompt_rows: also put loss on rows whose label lies in the prompt (needs ``labels="target"``
        to be meaningful: the prompt token itself is not the target's prediction).

    Returns a dict of numpy arrays, ``B = len(rows)``, ``W = seq_len``:
      ``ids i32[B,W]`` token x_{p+1}; ``hidden f32[B,W,H]`` target h_p; ``target_hidden f32[B,W,H]``
      target h_{p+1} (its logits are the target's distribution over x_{p+2});
      ``labels i32[B,W]`` (0 where absent); ``loss_mask f32[B,W]`` 1 on labelled rows;
      ``positions i32[B,W]`` p; ``segment_ids i32[B,W]`` (-1 = padding); ``src i32[B,W]`` the
      index of h_p in ``data.tokens`` / ``data.hidden`` (0 on padding rows).

    With ``with_hidden=False`` the two hidden arrays are left out (no ``[B, W, H]`` copy on the
    host): :func:`gather_hidden` takes them from a device copy of ``data.hidden`` by ``src``.

    Raises:
      ValueError: ``labels`` not "data"/"target", or "target" without ``data.top1``.
    """
    if labels not in ("data", "target"):
        raise ValueError(f"labels must be 'data' or 'target', got {labels!r}")
    if labels == "target" and data.top1 is None:
        raise ValueError("labels='target' needs MTPData.top1 (see target_top1)")
    b, w, h = len(rows), seq_len, data.hidden.shape[1]
    out = {
        "ids": np.zeros((b, w), np.int32), "labels": np.zeros((b, w), np.int32),
        "loss_mask": np.zeros((b, w), np.float32), "positions": np.zeros((b, w), np.int32),
        "segment_ids": np.full((b, w), -1, np.int32), "src": np.zeros((b, w), np.int32),
    }
    if with_hidden:
        out["hidden"] = np.zeros((b, w, h), np.float32)
        out["target_hidden"] = np.zeros((b, w, h), np.float32)
    for r, segs in enumerate(rows):
        o = 0
        for k, (s, start, cnt) in enumerate(segs):
            base = int(data.offsets[s])
            n = data.seq_len(s)
            p = np.arange(start, start + cnt)
            dst = slice(o, o + cnt)
            out["ids"][r, dst] = data.tokens[base + p + 1]
            out["src"][r, dst] = base + p
            if with_hidden:
                out["hidden"][r, dst] = data.hidden[base + start:base + start + cnt]
                out["target_hidden"][r, dst] = data.hidden[base + start + 1:base + start + cnt + 1]
            if labels == "target":
                has = np.ones(cnt, bool)
                out["labels"][r, dst] = data.top1[base + p + 1]
            else:
                has = p + 2 <= n - 1
                out["labels"][r, dst] = np.where(
                    has, data.tokens[np.minimum(base + p + 2, base + n - 1)], 0)
            in_resp = p + 2 >= int(data.prompt_lens[s])
            out["loss_mask"][r, dst] = (has & (in_resp | prompt_rows)).astype(np.float32)
            out["positions"][r, dst] = p
            out["segment_ids"][r, dst] = k
            o += cnt
    return out


@jax.jit
def gather_hidden(hidden: jax.Array, src: jax.Array, segment_ids: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """The ``hidden`` / ``target_hidden`` arrays of :func:`make_batch`, gathered on the device.

    Args:
      hidden: f[N, H] ``data.hidden`` held on the device (any float dtype).
      src: i32[B, W] the batch's ``src`` (index of h_p); segment_ids: i32[B, W] (-1 = padding).

    Returns:
      ``(f32[B, W, H] h_p, f32[B, W, H] h_{p+1})``, zero on padding rows, equal to
      :func:`make_batch`'s (``src + 1`` is always inside the row's sequence: an MTP row p has
      p <= n-2).
    """
    real = (segment_ids >= 0)[..., None]
    n = hidden.shape[0]
    h = jnp.where(real, hidden[src].astype(jnp.float32), 0.0)
    t = jnp.where(real, hidden[jnp.minimum(src + 1, n - 1)].astype(jnp.float32), 0.0)
    return h, t
