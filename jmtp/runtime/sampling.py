"""Per-request sampling parameters and the logits processing shared by verification and drafting.

Two layers:

* :class:`SamplingParams` -- the user-facing, vLLM-like request parameters (validated on
  construction).
* :class:`SamplingArrays` -- the same parameters as fixed-shape per-slot arrays (a pytree of device
  arrays, leading dim ``B`` = batch slots), plus per-slot history (prompt-token mask, counts of
  generated tokens, the last few tokens for multi-token bad words). Sampling parameters are *data*:
  a jitted step never recompiles when a value changes. Idle / padding slots hold neutral values
  (greedy, no penalties, nothing banned) and :func:`set_slot` / :func:`clear_slot` rewrite *every*
  array of a slot, so nothing leaks from a previous occupant or from padding into real rows.

Logits processing order (one row = the distribution of one output position; see :func:`penalize`
and :func:`target_probs`), following vLLM's V1 sampler:

1. **repetition penalty** over prompt ∪ generated tokens (HF ``RepetitionPenaltyLogitsProcessor``:
   ``logit / α`` if ``logit > 0`` else ``logit * α``);
2. **frequency / presence penalties** over generated tokens only (OpenAI / vLLM:
   ``logit -= frequency * count + presence * (count > 0)``);
3. **min_tokens**: while ``num_generated + w < min_tokens`` the slot's stop ids (``stop_token_ids``
   ∪ the EOS ids unless ``ignore_eos``) get ``-inf`` (vLLM ``MinTokensLogitsProcessor``);
4. **bad words**: single-token bad words (``bad_token_mask``) and multi-token ones (the last token
   of a sequence whose prefix equals the most recent tokens; HF ``NoBadWordsLogitsProcessor``,
   the history *includes* the prompt) get ``-inf``.
   The result is the *penalized* logits: greedy rows take their argmax and, by default, logprobs are
   computed from them.
5. **temperature** (``temperature < GREEDY_EPS`` = greedy: argmax of the penalized logits, no
   randomness consumed), then **min-p** (keep ``p >= min_p * max p``), **top-k** (keep logits
   ``>=`` the k-th largest: ties at the boundary are kept), **top-p** (on the top-k-renormalised
   distribution, keep the smallest prefix of the descending, index-stable order whose mass reaches
   ``top_p``), then softmax → the target distribution ``p``.

In speculative verification, row ``w`` of a window sees the history *including the drafts*
``d_1..d_w`` before it, so the processed distribution equals the one non-speculative decoding would
use at that position (see :func:`penalize`).

Randomness is position-based and per request: the key of output position ``n`` of the request in
slot ``b`` for purpose ``π`` is ``fold_in(key(seed[b]), n * NUM_PURPOSES + π)``
(:func:`request_keys`), so a request's tokens depend neither on its batch mates nor on how many
drafts earlier steps accepted.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

#: Rows with ``temperature < GREEDY_EPS`` are greedy (vLLM's ``_SAMPLING_EPS``).
GREEDY_EPS = 1e-5
#: Limits for frequency / presence penalties (OpenAI / vLLM).
PENALTY_LIMIT = 2.0

#: RNG purposes folded into the per-position key (:func:`request_keys`).
PURPOSE_ACCEPT = 0   # acceptance coin of a draft (rejection sampling)
PURPOSE_SAMPLE = 1   # a token sampled from the target (bonus / correction / target_match / topp)
PURPOSE_DRAFT = 2    # a draft token sampled from the proposer's distribution


def _err(field: str, value, limit: str) -> ValueError:
    return ValueError(f"SamplingParams.{field}={value!r}: must be {limit}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """User-facing sampling parameters of one request (vLLM-like).

    Fields:
      max_tokens: int >= 1, maximum number of generated tokens (enforced by the engine).
      temperature: float >= 0; ``< GREEDY_EPS`` means greedy decoding.
      top_p: float in (0, 1]. top_k: int >= 0, or -1 (0 and -1 = off, stored as 0; values above
        the vocabulary are clamped).
      min_p: float in [0, 1].
      repetition_penalty: float > 0 (1 = off), HF semantics over prompt ∪ generated tokens.
      frequency_penalty, presence_penalty: float in [-2, 2], over generated tokens only.
      min_tokens: int in [0, max_tokens]; stop ids are masked before that many tokens.
      stop_token_ids: ids that end the request (the emitted stop token is kept in the output).
      bad_token_ids: ids that are never generated.
      bad_words: strings the engine tokenizes into id sequences and passes to :func:`set_slot` as
        ``bad_words_ids`` (single-token words are banned everywhere, multi-token words ban their
        last token after the rest of the sequence, HF semantics).
      ignore_eos: EOS neither stops the request nor is masked by ``min_tokens``.
      seed: int in [0, 2**32) or None (the engine then supplies a request seed).
      logprobs: None or int >= 0: number of top logprobs returned per emitted token.
      n: int >= 1, independent samples of the prompt (distinct random streams; with ``seed``,
        sample 0 uses ``seed`` and sample i > 0 a seed derived from ``(seed, i)``).
      stop: None, a string or a sequence of non-empty strings; the engine ends a sample when its
        text contains one (checked after every token, also inside a multi-token verify step) and
        cuts the text before it (``finish_reason="stop"``, ``stop_reason`` = the string).
      include_stop_str_in_output: keep the matched stop string at the end of the text.

    Raises:
      ValueError naming the field and its limit for any out-of-range value.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    bad_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    stop: str | Sequence[str] | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, bytes) or not isinstance(stop, Sequence) or not all(
                isinstance(x, str) and x for x in stop):
            raise _err("stop", self.stop, "None, a string or a list of non-empty strings")
        if any(not x for x in stop):
            raise _err("stop", self.stop, "None, a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.include_stop_str_in_output, (bool, np.bool_)):
            raise _err("include_stop_str_in_output", self.include_stop_str_in_output, "a bool")
        for name in ("stop_token_ids", "bad_token_ids", "bad_words"):
            val = getattr(self, name)
            if isinstance(val, (str, bytes)) or not isinstance(val, Sequence):
                raise _err(name, val, "a sequence")
            object.__setattr__(self, name, tuple(val))

        def is_int(x):
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)

        for name in ("max_tokens", "top_k", "min_tokens", "n"):
            if not is_int(getattr(self, name)):
                raise _err(name, getattr(self, name), "an int")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not math.isfinite(float(v)):
                raise _err(name, v, "a finite number")
        if self.max_tokens < 1:
            raise _err("max_tokens", self.max_tokens, ">= 1")
        if self.temperature < 0:
            raise _err("temperature", self.temperature, ">= 0")
        if not 0 < self.top_p <= 1:
            raise _err("top_p", self.top_p, "in (0, 1]")
        if self.top_k < -1:
            raise _err("top_k", self.top_k, ">= 1, or 0 / -1 (off)")
        if self.top_k == -1:            # vLLM / OpenAI clients send -1 for "off": one meaning, 0
            object.__setattr__(self, "top_k", 0)
        if self.n < 1:
            raise _err("n", self.n, ">= 1")
        if not 0 <= self.min_p <= 1:
            raise _err("min_p", self.min_p, "in [0, 1]")
        if self.repetition_penalty <= 0:
            raise _err("repetition_penalty", self.repetition_penalty, "> 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if abs(getattr(self, name)) > PENALTY_LIMIT:
                raise _err(name, getattr(self, name), f"in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}]")
        if self.min_tokens < 0:
            raise _err("min_tokens", self.min_tokens, ">= 0")
        if self.min_tokens > self.max_tokens:
            raise _err("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("stop_token_ids", "bad_token_ids"):
            for t in getattr(self, name):
                if not is_int(t) or t < 0:
                    raise _err(name, getattr(self, name), "a tuple of token ids >= 0")
        for w in self.bad_words:
            if not isinstance(w, str) or not w:
                raise _err("bad_words", self.bad_words, "a tuple of non-empty strings")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise _err("ignore_eos", self.ignore_eos, "a bool")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**32):
            raise _err("seed", self.seed, "None or an int in [0, 2**32)")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise _err("logprobs", self.logprobs, "None or an int >= 0")

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (``temperature < GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-slot sampling state (a pytree; every field is data). ``B`` slots, vocabulary ``V``.

    Attributes:
      temperature: f32[B] (0 = greedy).  top_p: f32[B].  top_k: i32[B] (0 = off).  min_p: f32[B].
      repetition_penalty, frequency_penalty, presence_penalty: f32[B].
      min_tokens: i32[B].  ignore_eos: bool[B].
      stop_token_ids: i32[B, S] stop ids of the slot (-1 padded); includes the per-request EOS ids
        given to :func:`set_slot` unless ``ignore_eos``.
      bad_token_mask: bool[B, V] single-token bad words / ``bad_token_ids``.
      bad_word_seqs: i32[B, NW, LW] multi-token bad words, right-aligned, -1 left padding.
      recent_tokens: i32[B, LW-1] the last ``LW-1`` tokens of prompt + output (-1 where the history
        is shorter), for multi-token bad words.
      seed: u32[B] the request's RNG seed (see :func:`request_keys`).
      rng_offset: i32[B] tokens the request generated before its current admission (non-zero
        after a preemption): added to the per-admission ``step_idx`` to give the output position
        of every random draw, so a re-admitted request continues its random stream.
      prompt_mask: bool[B, V] token occurs in the prompt (repetition penalty).
      output_counts: i32[B, V] occurrences of each token among the generated tokens.
      logprobs: i32[B] requested number of top logprobs (-1 = none); informational for the engine.
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    frequency_penalty: jax.Array
    presence_penalty: jax.Array
    min_tokens: jax.Array
    ignore_eos: jax.Array
    stop_token_ids: jax.Array
    bad_token_mask: jax.Array
    bad_word_seqs: jax.Array
    recent_tokens: jax.Array
    seed: jax.Array
    rng_offset: jax.Array
    prompt_mask: jax.Array
    output_counts: jax.Array
    logprobs: jax.Array

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.bad_token_mask.shape[-1]

    @staticmethod
    def empty(batch_size: int, vocab_size: int, max_stop: int = 4, max_bad_words: int = 0,
              max_bad_word_len: int = 1, *, as_numpy: bool = False) -> "SamplingArrays":
        """All-neutral arrays for ``batch_size`` slots (greedy, no penalties, nothing banned).

        Args:
          batch_size, vocab_size: B, V >= 1.
          max_stop: S >= 1, capacity for stop ids (+ per-request EOS ids) per slot.
          max_bad_words: NW >= 0, capacity for multi-token bad words per slot.
          max_bad_word_len: LW >= 1, longest multi-token bad word.
          as_numpy: return numpy arrays (host-side packing) instead of jax arrays.
        Raises:
          ValueError naming the argument when a size is out of range.
        """
        for name, v, lo in (("batch_size", batch_size, 1), ("vocab_size", vocab_size, 1),
                            ("max_stop", max_stop, 1), ("max_bad_words", max_bad_words, 0),
                            ("max_bad_word_len", max_bad_word_len, 1)):
            if int(v) < lo:
                raise ValueError(f"SamplingArrays.empty: {name}={v} must be >= {lo}")
        B, V = int(batch_size), int(vocab_size)
        row = _neutral_row(V, max_stop, max_bad_words, max_bad_word_len)
        out = {k: np.repeat(v[None], B, axis=0) for k, v in row.items()}
        arrays = SamplingArrays(**out)
        return arrays if as_numpy else jax.tree.map(jnp.asarray, arrays)


def _neutral_row(V: int, S: int, NW: int, LW: int) -> dict[str, np.ndarray]:
    return dict(
        temperature=np.float32(0.0), top_p=np.float32(1.0), top_k=np.int32(0),
        min_p=np.float32(0.0), repetition_penalty=np.float32(1.0),
        frequency_penalty=np.float32(0.0), presence_penalty=np.float32(0.0),
        min_tokens=np.int32(0), ignore_eos=np.bool_(False),
        stop_token_ids=np.full((S,), -1, np.int32), bad_token_mask=np.zeros((V,), bool),
        bad_word_seqs=np.full((NW, LW), -1, np.int32),
        recent_tokens=np.full((LW - 1,), -1, np.int32),
        seed=np.uint32(0), rng_offset=np.int32(0), prompt_mask=np.zeros((V,), bool),
        output_counts=np.zeros((V,), np.int32),
        logprobs=np.int32(-1))


def make_row(params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int, *,
             max_stop: int, max_bad_words: int = 0, max_bad_word_len: int = 1,
             eos_ids: Sequence[int] = (), request_seed: int | None = None,
             bad_words_ids: Sequence[Sequence[int]] = ()) -> dict[str, np.ndarray]:
    """Host-side (numpy) values of one slot for ``params`` (shapes of one row of SamplingArrays).

    Args:
      params: the request's :class:`SamplingParams`.
      prompt_ids: the prompt token ids (for the repetition penalty and multi-token bad words).
      vocab_size: V. max_stop, max_bad_words, max_bad_word_len: S, NW, LW of the target arrays.
      eos_ids: per-request EOS ids, added to the slot's stop ids unless ``params.ignore_eos``.
      request_seed: used when ``params.seed`` is None; when both are None a random seed is drawn.
      bad_words_ids: ``params.bad_words`` tokenized by the engine; length-1 sequences are banned
        everywhere, longer ones go to ``bad_word_seqs``.
    Raises:
      ValueError naming the argument when an id is outside [0, V) or a capacity is exceeded.
    """
    V = int(vocab_size)
    row = _neutral_row(V, max_stop, max_bad_words, max_bad_word_len)
    prompt = np.asarray(list(prompt_ids), dtype=np.int64).reshape(-1)
    if prompt.size and (prompt.min() < 0 or prompt.max() >= V):
        raise ValueError(f"prompt_ids: token ids must be in [0, {V})")
    stops = list(dict.fromkeys(list(params.stop_token_ids)
                               + ([] if params.ignore_eos else [int(e) for e in eos_ids])))
    if any(t >= V or t < 0 for t in stops):
        raise ValueError(f"stop_token_ids / eos_ids: ids must be in [0, {V}), got {stops}")
    if len(stops) > max_stop:
        raise ValueError(f"stop_token_ids: {len(stops)} stop ids (incl. EOS) exceed max_stop="
                         f"{max_stop}")
    if any(t >= V for t in params.bad_token_ids):
        raise ValueError(f"bad_token_ids: ids must be < vocab_size={V}")
    multi = []
    row["bad_token_mask"][list(params.bad_token_ids)] = True
    for seq in bad_words_ids:
        seq = [int(t) for t in seq]
        if not seq or any(t < 0 or t >= V for t in seq):
            raise ValueError(f"bad_words_ids: each sequence must be non-empty with ids in [0, {V})")
        if len(seq) == 1:
            row["bad_token_mask"][seq[0]] = True
        else:
            multi.append(seq)
    if len(multi) > max_bad_words:
        raise ValueError(f"bad_words_ids: {len(multi)} multi-token bad words exceed max_bad_words="
                         f"{max_bad_words}")
    for n, seq in enumerate(multi):
        if len(seq) > max_bad_word_len:
            raise ValueError(f"bad_words_ids: a bad word of {len(seq)} tokens exceeds "
                             f"max_bad_word_len={max_bad_word_len}")
        row["bad_word_seqs"][n, max_bad_word_len - len(seq):] = seq
    seed = params.seed if params.seed is not None else request_seed
    if seed is None:
        seed = int(np.random.default_rng().integers(0, 2**32))
    if not 0 <= int(seed) < 2**32:
        raise ValueError(f"request_seed={seed} must be in [0, 2**32)")
    if max_bad_word_len > 1 and prompt.size:
        tail = prompt[-(max_bad_word_len - 1):]
        row["recent_tokens"][max_bad_word_len - 1 - tail.size:] = tail
    row["stop_token_ids"][: len(stops)] = stops
    row["prompt_mask"][prompt] = True
    row.update(
        temperature=np.float32(params.temperature), top_p=np.float32(params.top_p),
        top_k=np.int32(min(params.top_k, V)), min_p=np.float32(params.min_p),
        repetition_penalty=np.float32(params.repetition_penalty),
        frequency_penalty=np.float32(params.frequency_penalty),
        presence_penalty=np.float32(params.presence_penalty),
        min_tokens=np.int32(params.min_tokens), ignore_eos=np.bool_(params.ignore_eos),
        seed=np.uint32(seed), logprobs=np.int32(-1 if params.logprobs is None else params.logprobs))
    return row


def _shape_of(arrays: SamplingArrays) -> tuple[int, int, int, int]:
    return (arrays.vocab_size, arrays.stop_token_ids.shape[1], arrays.bad_word_seqs.shape[1],
            arrays.bad_word_seqs.shape[2])


@jax.jit
def _write_row(arrays: SamplingArrays, slot, row: dict) -> SamplingArrays:
    return dataclasses.replace(arrays, **{k: getattr(arrays, k).at[slot].set(v)
                                          for k, v in row.items()})


def _put_row(arrays: SamplingArrays, slot: int, row: dict) -> SamplingArrays:
    B = arrays.batch_size
    if not 0 <= int(slot) < B:
        raise ValueError(f"slot={slot} must be in [0, {B})")
    if isinstance(arrays.temperature, np.ndarray):
        out = {}
        for k, v in row.items():
            a = getattr(arrays, k).copy()
            a[int(slot)] = v
            out[k] = a
        return dataclasses.replace(arrays, **out)
    return _write_row(arrays, jnp.int32(slot), row)


def set_slot(arrays: SamplingArrays, slot: int, params: SamplingParams, prompt_ids: Sequence[int],
             vocab_size: int | None = None, eos_ids: Sequence[int] = (),
             request_seed: int | None = None,
             bad_words_ids: Sequence[Sequence[int]] = ()) -> SamplingArrays:
    """Return ``arrays`` with every field of ``slot`` rewritten for a new request.

    The output counts are reset, the prompt mask rebuilt: nothing of the previous occupant
    survives. Works on numpy- or jax-backed arrays (jax: one jitted scatter, no retrace per slot).
    Arguments as in :func:`make_row`; ``vocab_size`` defaults to (and must equal) ``arrays``'s V.
    Raises:
      ValueError naming the argument (slot out of range, ids out of range, capacity exceeded).
    """
    V, S, NW, LW = _shape_of(arrays)
    if vocab_size is not None and int(vocab_size) != V:
        raise ValueError(f"vocab_size={vocab_size} != the arrays' vocabulary size {V}")
    row = make_row(params, prompt_ids, V, max_stop=S, max_bad_words=NW, max_bad_word_len=LW,
                   eos_ids=eos_ids, request_seed=request_seed, bad_words_ids=bad_words_ids)
    return _put_row(arrays, slot, row)


def clear_slot(arrays: SamplingArrays, slot: int) -> SamplingArrays:
    """Return ``arrays`` with ``slot`` reset to neutral values (idle / padding slot)."""
    V, S, NW, LW = _shape_of(arrays)
    return _put_row(arrays, slot, _neutral_row(V, S, NW, LW))


def pack_sampling(params: Sequence[SamplingParams | None], batch_size: int, vocab_size: int, *,
                  prompts: Sequence[Sequence[int]] | None = None, max_stop: int = 4,
                  max_bad_words: int = 0, max_bad_word_len: int = 1, eos_ids: Sequence[int] = (),
                  seeds: Sequence[int | None] | None = None,
                  bad_words_ids: Sequence[Sequence[Sequence[int]]] | None = None,
                  as_numpy: bool = False) -> SamplingArrays:
    """Build :class:`SamplingArrays` for ``batch_size`` slots from a list of params (None = idle).

    ``params[i]`` fills slot ``i`` (``len(params) <= batch_size``; the rest are idle), with
    ``prompts[i]``, ``seeds[i]`` (request seed) and ``bad_words_ids[i]`` when given.
    Raises:
      ValueError naming the argument when there are more params than slots.
    """
    if len(params) > batch_size:
        raise ValueError(f"params: {len(params)} requests exceed batch_size={batch_size}")
    arrays = SamplingArrays.empty(batch_size, vocab_size, max_stop, max_bad_words,
                                  max_bad_word_len, as_numpy=True)
    fields = {f.name: getattr(arrays, f.name).copy() for f in dataclasses.fields(arrays)}
    for i, p in enumerate(params):
        if p is None:
            continue
        row = make_row(p, prompts[i] if prompts is not None else (), vocab_size,
                       max_stop=max_stop, max_bad_words=max_bad_words,
                       max_bad_word_len=max_bad_word_len, eos_ids=eos_ids,
                       request_seed=seeds[i] if seeds is not None else 0,
                       bad_words_ids=bad_words_ids[i] if bad_words_ids is not None else ())
        for k, v in row.items():
            fields[k][i] = v
    arrays = SamplingArrays(**fields)
    return arrays if as_numpy else jax.tree.map(jnp.asarray, arrays)


# ----------------------------------------------------------------------------------------------
# Randomness


#: Number of RNG purposes: the key data folded in is ``position * NUM_PURPOSES + purpose``.
NUM_PURPOSES = 4


def request_keys(seed: jax.Array, positions: jax.Array, purpose) -> jax.Array:
    """Typed PRNG keys ``key[positions.shape]``: ``fold_in(key(seed[b]), n * NUM_PURPOSES + π)``.

    One key per (request seed, output position ``n``, purpose ``π``); the pair is packed into one
    ``fold_in`` (injective for positions below 2**29), which is the nested
    ``fold_in(fold_in(key, n), π)`` scheme with one hash instead of two.

    Args:
      seed: u32[B] request seeds.
      positions: i32[B, ...] output positions (0 = the first generated token).
      purpose: a ``PURPOSE_*`` constant, or an int array broadcastable to ``positions``.
    """
    data = (positions.astype(jnp.uint32) * jnp.uint32(NUM_PURPOSES)
            + jnp.asarray(purpose, jnp.uint32))
    base = jax.vmap(jax.random.key)(seed.astype(jnp.uint32))
    flat = data.reshape(data.shape[0], -1)
    keys = jax.vmap(lambda k, ds: jax.vmap(lambda d: jax.random.fold_in(k, d))(ds))(base, flat)
    return keys.reshape(data.shape)


def _uniform(keys: jax.Array) -> jax.Array:
    """One uniform draw in [0, 1) per key: ``f32[keys.shape]``."""
    flat = keys.reshape(-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(flat)
    return u.reshape(keys.shape)


def uniform_draws(seed: jax.Array, positions: jax.Array, purpose) -> jax.Array:
    """``f32[...]`` in [0, 1), one per (request, position, purpose); see :func:`request_keys`.

    Call it once per jitted function with every (position, purpose) needed: each call site
    compiles its own hash.
    """
    return _uniform(request_keys(seed, positions, purpose))


def sample_from_probs(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF sampling of ``i32[...]`` from ``probs f32[..., V]`` (unnormalised) and ``u``.

    ``u`` (``f32[...]``) must be in [0, 1).

    Returns the first token whose cumulative mass exceeds ``u * total``, restricted to tokens with
    positive mass, so a zero-probability token is never returned, also for ``u == 0`` (and rounding
    in the cumulative sum cannot select one). If ``total == 0`` the argmax (token 0) is returned.
    """
    probs = jnp.maximum(probs, 0.0)
    c = jnp.cumsum(probs, axis=-1)
    total = c[..., -1]
    t = (u * total)[..., None]
    pos = probs > 0
    hit = (c > t) & pos
    V = probs.shape[-1]
    last_pos = V - 1 - jnp.argmax(pos[..., ::-1], axis=-1)
    idx = jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last_pos)
    return jnp.where(total > 0, idx, jnp.argmax(probs, axis=-1)).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Logits processing


def stop_mask(sampling: SamplingArrays, eos_token_ids: jax.Array) -> jax.Array:
    """``bool[B, V]``: ids that stop the slot's request: its stop ids, plus ``eos_token_ids``
    (``i32[E]``, -1 entries ignored) unless ``ignore_eos``."""
    B, V = sampling.bad_token_mask.shape
    rows = jnp.arange(B)[:, None]
    st = sampling.stop_token_ids
    m = jnp.zeros((B, V), bool).at[rows, jnp.where(st >= 0, st, V)].set(True, mode="drop")
    eos = jnp.asarray(eos_token_ids, jnp.int32).reshape(-1)
    eos_m = jnp.zeros((V,), bool).at[jnp.where(eos >= 0, eos, V)].set(True, mode="drop")
    return m | (eos_m[None, :] & ~sampling.ignore_eos[:, None])


def window_history(sampling: SamplingArrays, draft_tokens: jax.Array, num_drafts: jax.Array):
    """Generated-token counts seen by each window row: ``i32[B, K+1, V]``.

    Row ``w`` counts ``output_counts`` plus the drafts ``d_1..d_w`` (``draft_tokens[:, :w]``, only
    those below ``num_drafts``). Written as K elementwise terms (no one-hot / cumsum buffer), so
    XLA fuses it into the penalty computation.
    """
    B, K = draft_tokens.shape
    V = sampling.vocab_size
    vocab = jnp.arange(V, dtype=jnp.int32)[None, None, :]
    row = jnp.arange(K + 1, dtype=jnp.int32)[None, :, None]
    counts = jnp.broadcast_to(sampling.output_counts[:, None, :], (B, K + 1, V))
    for i in range(K):
        hit = ((row > i) & (i < num_drafts)[:, None, None]
               & (vocab == draft_tokens[:, i, None, None]))
        counts = counts + hit.astype(jnp.int32)
    return counts


def _bad_word_ban(sampling: SamplingArrays, draft_tokens: jax.Array) -> jax.Array:
    """``bool[B, K+1, V]``: last tokens of multi-token bad words whose prefix matches the context
    (the last ``LW-1`` tokens of prompt + output + the drafts before the row)."""
    B, K = draft_tokens.shape
    V = sampling.vocab_size
    NW, LW = sampling.bad_word_seqs.shape[1:]
    if NW == 0 or LW < 2:
        return jnp.zeros((B, K + 1, V), bool)
    R = LW - 1
    ctx = jnp.concatenate([sampling.recent_tokens, draft_tokens], axis=1)        # [B, R+K]
    idx = jnp.arange(K + 1)[:, None] + jnp.arange(R)[None, :]                    # [K+1, R]
    win = ctx[:, idx]                                                           # [B, K+1, R]
    prefix = sampling.bad_word_seqs[:, :, :R]                                   # [B, NW, R]
    last = sampling.bad_word_seqs[:, :, R]                                      # [B, NW]
    ok = (prefix[:, None] == -1) | (prefix[:, None] == win[:, :, None])          # [B,K+1,NW,R]
    match = jnp.all(ok, axis=-1) & (last >= 0)[:, None, :]                       # [B, K+1, NW]
    vocab = jnp.arange(V, dtype=jnp.int32)[None, None, :]
    ban = jnp.zeros((B, K + 1, V), bool)
    for n in range(NW):
        ban = ban | (match[:, :, n, None] & (vocab == last[:, n, None, None]))
    return ban


def penalize(logits: jax.Array, sampling: SamplingArrays, draft_tokens: jax.Array,
             num_drafts: jax.Array, num_generated: jax.Array,
             eos_token_ids: jax.Array) -> jax.Array:
    """Penalties, min_tokens and bad words for every row of a verify window.

    Args:
      logits: f[B, W, V] target logits; row ``w`` = distribution after input ``w`` (W = K+1).
      sampling: :class:`SamplingArrays` of the B slots.
      draft_tokens: i32[B, K] drafts d_1..d_K (entries at or past ``num_drafts`` are ignored).
      num_drafts: i32[B]. num_generated: i32[B] tokens generated before this step.
      eos_token_ids: i32[E] model EOS ids (-1 entries ignored).
    Returns:
      f32[B, W, V] penalized logits (``-inf`` for masked ids). Row ``w`` uses the history
      prompt ∪ generated ∪ {d_1..d_w} and the min_tokens test ``num_generated + w < min_tokens``.
    """
    logits = logits.astype(jnp.float32)
    B, W, V = logits.shape
    K = W - 1
    if draft_tokens.shape != (B, K):
        raise ValueError(f"draft_tokens: shape {draft_tokens.shape} != (B, K) = {(B, K)}")
    num_drafts = jnp.clip(num_drafts.astype(jnp.int32), 0, K)
    counts = window_history(sampling, draft_tokens.astype(jnp.int32), num_drafts)   # [B, W, V]
    seen = counts > 0
    rep = sampling.repetition_penalty[:, None, None]
    in_hist = seen | sampling.prompt_mask[:, None, :]
    penal = jnp.where(logits > 0, logits / rep, logits * rep)
    x = jnp.where(in_hist, penal, logits)
    x = (x - sampling.frequency_penalty[:, None, None] * counts.astype(jnp.float32)
         - sampling.presence_penalty[:, None, None] * seen.astype(jnp.float32))
    w = jnp.arange(W, dtype=jnp.int32)[None, :]
    too_early = (num_generated.astype(jnp.int32)[:, None] + w) < sampling.min_tokens[:, None]
    ban = (too_early[:, :, None] & stop_mask(sampling, eos_token_ids)[:, None, :])
    ban = ban | sampling.bad_token_mask[:, None, :] | _bad_word_ban(sampling, draft_tokens)
    return jnp.where(ban, -jnp.inf, x)


def _softmax(z: jax.Array) -> jax.Array:
    m = jnp.max(z, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(z - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(s > 0, s, 1.0)


#: Up to this vocabulary size :func:`filter_logits` ranks by pairwise comparison instead of sorting.
PAIRWISE_MAX_V = 16


def _rank_filter(z, k, top_p):
    """top-k / top-p keep-mask from stable descending ranks computed pairwise (O(V^2), unrolled
    over V: only for tiny vocabularies, where it is much faster than a sort on CPU)."""
    V = z.shape[-1]
    ids = jnp.arange(V)[None, :]

    def before(j):                      # does id j rank before each id i?
        zj = z[:, j:j + 1]
        return (zj > z) | ((zj == z) & (j < ids))

    rank = sum(before(j).astype(jnp.int32) for j in range(V))                     # [N, V]
    kth = jnp.max(jnp.where(rank == (k - 1)[:, None], z, -jnp.inf), axis=-1, keepdims=True)
    keep_k = z >= kth
    p = _softmax(jnp.where(keep_k, z, -jnp.inf))
    excl = sum(jnp.where(before(j), p[:, j:j + 1], 0.0) for j in range(V))        # mass before
    return keep_k & ((excl < top_p[:, None]) | (top_p[:, None] >= 1.0))


def _sort_filter(z, k, top_p):
    """Same keep-mask as :func:`_rank_filter` through one stable sort (large V)."""
    N, V = z.shape
    order = jnp.argsort(-z, axis=-1, stable=True)
    zs = jnp.take_along_axis(z, order, axis=-1)
    kth = jnp.take_along_axis(zs, (k - 1)[:, None], axis=-1)
    keep_k = zs >= kth
    ps = _softmax(jnp.where(keep_k, zs, -jnp.inf))
    excl = jnp.concatenate([jnp.zeros((N, 1), ps.dtype), jnp.cumsum(ps, axis=-1)[:, :-1]], -1)
    keep_s = keep_k & ((excl < top_p[:, None]) | (top_p[:, None] >= 1.0))
    # the kept ids are a prefix of the sorted order: map back through its last element
    m = jnp.maximum(jnp.sum(keep_s, axis=-1), 1)[:, None]
    thr = jnp.take_along_axis(zs, m - 1, axis=-1)
    last = jnp.take_along_axis(order, m - 1, axis=-1)
    return (z > thr) | ((z == thr) & (jnp.arange(V)[None, :] <= last))


def filter_logits(z: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                  method: str = "auto") -> jax.Array:
    """min-p, then top-k, then top-p on temperature-scaled logits ``z f32[N, V]`` (params ``[N]``).

    Returns ``z`` with removed ids set to ``-inf``. min-p removes ids with ``p < min_p * max p``.
    top-k keeps every id ``>=`` the k-th largest value (0 = off; ties at the k-th value are kept).
    top-p keeps, in the descending order with ties broken by lower id, each id whose preceding
    mass (after top-k renormalisation) is ``< top_p`` (``top_p >= 1`` = off): the smallest prefix
    reaching ``top_p``. All of it is skipped (``lax.cond``) when no row uses min-p, top-k or top-p.

    ``method`` (static): ``"sort"`` (one stable sort), ``"pairwise"`` (O(V^2) ranks, faster for
    tiny vocabularies) or ``"auto"`` (pairwise when ``V <= PAIRWISE_MAX_V``); same result.
    """
    N, V = z.shape
    if method not in ("auto", "sort", "pairwise"):
        raise ValueError(f"method={method!r}: must be 'auto', 'sort' or 'pairwise'")
    pairwise = method == "pairwise" or (method == "auto" and V <= PAIRWISE_MAX_V)
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V).astype(jnp.int32)
    need = jnp.any((k < V) | (top_p < 1.0) | (min_p > 0.0))

    def filt(z):
        z = jnp.where(z == 0, 0.0, z)      # -0.0 == +0.0 must also tie in the sort order
        p = _softmax(z)
        z = jnp.where(p < min_p[:, None] * jnp.max(p, axis=-1, keepdims=True), -jnp.inf, z)
        keep = (_rank_filter if pairwise else _sort_filter)(z, k, top_p)
        return jnp.where(keep, z, -jnp.inf)

    return jax.lax.cond(need, filt, lambda z: z, z)


def target_probs(penalized: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """The target distribution ``p f32[B, W, V]`` from penalized logits ``f32[B, W, V]``.

    Sampled rows: softmax of the temperature-scaled logits after min-p, top-k and top-p. Greedy rows
    (``temperature < GREEDY_EPS``): one-hot of the argmax of the penalized logits.
    """
    B, W, V = penalized.shape
    greedy = sampling.temperature < GREEDY_EPS
    temp = jnp.where(greedy, 1.0, sampling.temperature)
    z = penalized / temp[:, None, None]
    rep = lambda a: jnp.repeat(a, W)  # noqa: E731  per-row params for the [B*W] rows
    zf = filter_logits(z.reshape(B * W, V), rep(sampling.top_k), rep(sampling.top_p),
                       rep(sampling.min_p)).reshape(B, W, V)
    p = _softmax(zf)
    am = jax.nn.one_hot(jnp.argmax(penalized, axis=-1), V, dtype=jnp.float32)
    ok = jnp.sum(p, axis=-1, keepdims=True) > 0
    p = jnp.where(ok, p, am)
    return jnp.where(greedy[:, None, None], am, p)


# ----------------------------------------------------------------------------------------------
# Drafting and history


def draft_sample(logits: jax.Array, sampling: SamplingArrays, positions: jax.Array | None = None,
                 *, draft_sampling: bool = False, draft_temperature: float | None = None,
                 draft_top_p: float | None = None, draft_top_k: int | None = None,
                 key: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Pick one draft token per slot from the proposer's logits.

    Args:
      logits: f[B, V] proposer logits for the next draft of each slot.
      sampling: the slots' :class:`SamplingArrays` (seed, and temperature/top-p/top-k defaults).
      positions: i32[B] output position of the token being drafted (``num_generated`` of the step
        being drafted for + draft index, counted from the current admission: ``sampling.rng_offset``
        is added); required with ``draft_sampling`` unless ``key`` is given.
      draft_sampling: static. False (default): greedy drafts, returns ``(argmax, None)`` -- the
        verifier then treats q as one-hot. True: sample with the draft temperature / top-p /
        top-k and return the exact distribution sampled from.
      draft_temperature, draft_top_p, draft_top_k: draft-side overrides (the analog of FastDeploy's
        ``FD_SPECULATE_SAMPLING_TOP_P/TOP_K``); None = the request's own value. Rows whose
        (effective) temperature is ``< GREEDY_EPS`` draft greedily (q one-hot).
      key: optional PRNG key replacing the per-request seeds (rows then use
        ``fold_in(key, row)`` and the position; outputs depend on the row index).
    Returns:
      ``(tokens i32[B], q f32[B, V] | None)``. No penalties are applied to drafts: q is exactly the
      distribution the token was sampled from (what :func:`jmtp.runtime.verify.verify` needs).
    Raises:
      ValueError if ``draft_sampling`` and neither ``positions`` nor ``key`` is given.
    """
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    if not draft_sampling:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    if positions is None and key is None:
        raise ValueError("draft_sample: positions (i32[B]) or key is required with draft_sampling")

    def per_row(override, default, dtype):
        if override is None:
            return default.astype(dtype)
        return jnp.broadcast_to(jnp.asarray(override, dtype), (B,))

    temp = per_row(draft_temperature, sampling.temperature, jnp.float32)
    top_p = per_row(draft_top_p, sampling.top_p, jnp.float32)
    top_k = per_row(draft_top_k, sampling.top_k, jnp.int32)
    greedy = temp < GREEDY_EPS
    z = logits / jnp.where(greedy, 1.0, temp)[:, None]
    q = _softmax(filter_logits(z, top_k, top_p, jnp.zeros((B,), jnp.float32)))
    am = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    q = jnp.where(greedy[:, None] | (jnp.sum(q, -1, keepdims=True) <= 0), am, q)
    pos = jnp.zeros((B,), jnp.int32) if positions is None else positions.astype(jnp.int32)
    if key is None:
        u = uniform_draws(sampling.seed, pos + sampling.rng_offset, PURPOSE_DRAFT)
    else:
        keys = jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(
            jax.random.fold_in(key, r), p), PURPOSE_DRAFT))(jnp.arange(B, dtype=jnp.uint32),
                                                            pos.astype(jnp.uint32))
        u = _uniform(keys)
    tok = sample_from_probs(q, u)
    return tok, q


def update_history(sampling: SamplingArrays, accept_tokens: jax.Array,
                   accept_num: jax.Array) -> SamplingArrays:
    """Add emitted tokens to ``output_counts`` and ``recent_tokens``.

    Args:
      accept_tokens: i32[B, N] emitted tokens (entries at or past ``accept_num`` or < 0 ignored).
      accept_num: i32[B] tokens emitted per slot this step (0 = none).
    Returns:
      the updated :class:`SamplingArrays` (all other fields unchanged).
    """
    B, N = accept_tokens.shape
    V = sampling.vocab_size
    tok = accept_tokens.astype(jnp.int32)
    n = jnp.clip(accept_num.astype(jnp.int32), 0, N)
    valid = (jnp.arange(N)[None, :] < n[:, None]) & (tok >= 0) & (tok < V)
    counts = sampling.output_counts.at[jnp.arange(B)[:, None], jnp.where(valid, tok, V)].add(
        1, mode="drop")
    R = sampling.recent_tokens.shape[1]
    recent = sampling.recent_tokens
    if R > 0:
        ctx = jnp.concatenate([recent, jnp.where(valid, tok, -1)], axis=1)       # [B, R+N]
        idx = n[:, None] + jnp.arange(R)[None, :]
        recent = jnp.take_along_axis(ctx, idx, axis=1)
    return dataclasses.replace(sampling, output_counts=counts, recent_tokens=recent)
