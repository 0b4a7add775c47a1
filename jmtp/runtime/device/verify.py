"""Verification of a speculative window: pure, jit-compatible, per-request parameters as data.

Input per slot ``b``: the target logits of the window rows ``w = 0..K`` (row ``w`` = distribution
of the token after input ``w``; input 0 is the last emitted token, input ``w >= 1`` is draft
``d_w``), the drafts ``d_1..d_K`` (``num_drafts[b]`` of them), and optionally ``q``, the
distribution each draft was sampled from. Output: ``accept_num[b]`` in ``[1, num_drafts+1]``
tokens -- the accepted drafts, then one correction/bonus token -- cut after the first stop token.
The token at index ``w`` of the output always comes from row ``w``.

Every row is processed with the history including the drafts before it (penalties, min_tokens,
bad words; :func:`jmtp.runtime.device.sampling.processors.penalize`), so the exact strategies change
nothing but speed.

Strategies (``strategy=``):

* ``"auto"`` / ``"rejection"`` (the default; the two names are the same rule): speculative
  sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
  Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").
  Accept ``d`` with probability ``min(1, p(d)/q(d))`` (coin ``c = 1 - u`` in (0, 1], accept iff
  ``p(d) > 0`` and ``c·q(d) <= p(d)``); at the first rejection sample from
  ``norm(max(0, p - q))``; if every draft is accepted, sample the bonus from ``p`` of the next row.
  ``draft_probs=None`` means one-hot q (greedy drafts; the rule is then lossless for any draft
  chosen independently of the target's draws). Greedy rows (temperature 0, whose ``p`` is the
  argmax one-hot, for which the rule *is* argmax matching) use exact argmax matching and consume
  no randomness, so one batch mixes both. Lossless.
* ``"greedy"``: every row is treated as temperature 0 (argmax matching, argmax correction).
* ``"target_match"``: sample ``t_w ~ p_w`` at every row, accept while ``d_{w+1} == t_w``, emit
  ``t_j`` at the first mismatch (or the bonus). Lossless for any drafts; acceptance ``Σ p·q``
  instead of ``Σ min(p, q)``.
* ``"topp"``: FastDeploy's rule (its ``SpeculativeSampler``: ``top_p_candidates`` then
  ``speculate_verify``), **lossy**, for parity. Probs = softmax(penalized logits / temperature)
  (min-p and top-k are not applied, as in FastDeploy; greedy rows use temperature 1 and
  ``top_p = 1e-5`` like FastDeploy's input processor). Candidates = the top-``C`` ids by
  probability (ties: lower id first); ``len`` = the smallest ``n`` whose top-n mass is
  ``>= top_p``, else ``C`` when ``top_p == 1`` and **0** otherwise (FastDeploy's
  ``actual_candidate_len`` when the top-C mass falls short of ``top_p``, replicated unless
  ``topp_clamp_candidate_len=True``, which clamps to ``C``). A draft is accepted iff it is among
  the first ``len`` candidates. At the first rejected row ``i``: if ``C >= 2``, ``d_{i+1}`` is the
  second candidate and the next ``verify_window`` drafts all equal their row's top-1 candidate (so
  at least ``verify_window`` further drafts exist), all ``verify_window + 1`` drafts are accepted
  (window relaxation, also for greedy rows, as in FastDeploy). The correction/bonus token is drawn
  from the candidates of the row after the last accepted draft:
  ``T* = min(sum of the first len scores, top_p)``, ``u ~ U(0, 1]``, the first candidate (among
  the first ``len``) with cumulative score ``>= u·T*``, else candidate 0. Deliberate deviations
  from FastDeploy: EOS inside an accepted window truncates at the first EOS (FastDeploy's
  ``speculate_verify`` subtracts only one from ``accept_num``); a zero-probability candidate is
  never accepted (FastDeploy can accept one when ``top_p == 1`` and the top-C float sum falls
  short of 1); penalties use the exact per-row history (FastDeploy reads the bad words of slot 0
  for every slot and does not update the counts inside a verify window); randomness is per
  request.

After the strategy, tokens are cut after the first stop token (the slot's ``stop_token_ids``, and
``eos_token_ids`` unless ``ignore_eos``) when ``truncate_at_stop`` (default). ``max_tokens`` is
left to the engine.

Logprobs (``num_logprobs > 0``) are those of the target distribution at each emitted position,
bonus token included; by default (``logprobs_mode="penalized"``) the log-softmax of the logits
after penalties, min_tokens and bad words, before temperature and top-k/top-p/min-p. Since row
``w`` sees exactly the non-speculative history, they equal the logprobs without speculation.

Randomness: the draw for output position ``n`` of slot ``b`` comes from
``fold_in(key(seed[b]), n * NUM_PURPOSES + purpose)`` with
``n = rng_offset[b] + num_generated[b] + w`` (:func:`jmtp.runtime.device.sampling.rng.request_keys`; the
offset is non-zero for a request re-admitted after a preemption); one uniform per row for the acceptance coin, one per
row for sampling. Every draw that influenced the emitted tokens belongs to a position below the
next step's ``num_generated``, so reusing keys by position across steps keeps the draws
independent of everything already decided.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jmtp.runtime.config import VERIFY_STRATEGIES
from jmtp.runtime.device import sampling as smp
from jmtp.runtime.device.sampling import SamplingArrays
from jmtp.runtime.device.sampling.processors import safe_softmax
from jmtp.runtime.device.sharding import uniform_any

LOGPROBS_MODES = ("penalized", "raw", "final")
#: FastDeploy's greedy rewrite for the topp rule (``top_p < 1e-5 → 1e-5``, temperature → 1).
FD_GREEDY_TOP_P = 1e-5


def check_strategy(strategy: str) -> str:
    """Return ``strategy`` if known. Raises ValueError naming ``strategy`` otherwise."""
    if strategy not in VERIFY_STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: must be one of {VERIFY_STRATEGIES}")
    return strategy


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Result of :func:`verify` for B slots and a window of W = K+1 rows.

    Attributes:
      accept_tokens: i32[B, K+1] emitted tokens: accepted drafts, then the correction/bonus token;
        -1 at and past ``accept_num``.
      accept_num: i32[B] number of emitted tokens, in ``[1, num_drafts + 1]``.
      logprobs: f32[B, K+1] logprob of each emitted token (0 past ``accept_num``), or None when
        ``num_logprobs == 0``.
      top_logprob_ids: i32[B, K+1, n] ids of the n most likely tokens of each row (ties: lower
        id first), or None. Rows at and past ``accept_num`` are meaningless.
      top_logprobs: f32[B, K+1, n] their logprobs, or None.
    """

    accept_tokens: jax.Array
    accept_num: jax.Array
    logprobs: jax.Array | None = None
    top_logprob_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def _take_row(x: jax.Array, row: jax.Array) -> jax.Array:
    """``x[b, row[b]]`` for ``x [B, W, ...]`` and ``row i32[B]`` (clipped)."""
    row = jnp.clip(row, 0, x.shape[1] - 1)
    return jax.vmap(lambda xb, r: xb[r])(x, row)


def _leading_true(acc: jax.Array) -> jax.Array:
    """Number of leading True entries along axis 1: ``i32[B]`` (0 for an empty axis)."""
    if acc.shape[1] == 0:
        return jnp.zeros((acc.shape[0],), jnp.int32)
    return jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _rejection(pen, d, valid, nd, draft_probs, sampling, u, greedy_row):
    """Rejection sampling for sampled rows, exact match for greedy rows; when every row is greedy
    the target distributions are never formed (``lax.cond``), the same result for less work."""
    W = pen.shape[1]

    def all_greedy(_):
        argmax_t = smp.vocab_argmax(pen)   # i32[B, W]
        a = _leading_true(valid & (d == argmax_t[:, :W - 1]))
        return a, _take_row(argmax_t[..., None], a)[:, 0]

    return jax.lax.cond(~uniform_any(~greedy_row), all_greedy, lambda _: _rejection_sampled(
        pen, d, valid, nd, draft_probs, sampling, u, greedy_row), None)


def _rejection_sampled(pen, d, valid, nd, draft_probs, sampling, u, greedy_row):
    B, W, V = pen.shape
    K = W - 1
    argmax_t = smp.vocab_argmax(pen)   # i32[B, W]
    p = smp.target_probs(pen, sampling)                                       # [B, W, V]
    pd = jnp.take_along_axis(p[:, :K], d[..., None], axis=-1)[..., 0]         # [B, K]
    if draft_probs is not None:
        # A row of q with no mass is a deterministic draft (e.g. an n-gram draft in a batch of
        # sampled MTP drafts): its exact q is one-hot. Without this, q(d) = 0 would accept d
        # whenever p(d) > 0, which is lossy.
        draft_probs = draft_probs.astype(jnp.float32)
        empty = jnp.sum(draft_probs, axis=-1, keepdims=True) <= 0
        draft_probs = jnp.where(empty, jax.nn.one_hot(d, V, dtype=jnp.float32), draft_probs)
    if draft_probs is None:
        qd = jnp.ones_like(pd)
    else:
        qd = jnp.take_along_axis(draft_probs, d[..., None], axis=-1)[..., 0]
    coin = 1.0 - u[:, :K, 0]                                                  # (0, 1]
    acc_sampled = (pd > 0) & (coin * qd <= pd)
    acc_greedy = d == argmax_t[:, :K]
    acc = valid & jnp.where(greedy_row[:, None], acc_greedy, acc_sampled)
    a = _leading_true(acc)                                                    # [B]
    p_j = _take_row(p, a)                                                     # [B, V]
    if K == 0:
        dist = p_j
    else:
        if draft_probs is None:
            q_j = jax.nn.one_hot(_take_row(d[..., None], a)[:, 0], V, dtype=jnp.float32)
        else:
            q_j = _take_row(draft_probs.astype(jnp.float32), a)
        resid = jnp.maximum(p_j - q_j, 0.0)
        use_resid = (a < nd) & (jnp.sum(resid, axis=-1) > 0)
        dist = jnp.where(use_resid[:, None], resid, p_j)
    final = jnp.where(greedy_row, _take_row(argmax_t[..., None], a)[:, 0],
                      smp.sample_from_probs(dist, _take_row(u[..., 1:], a)[:, 0]))
    return a, final


def _match(pen, d, valid, sampling, u, greedy_row, sample: bool):
    B, W, V = pen.shape
    K = W - 1
    t = smp.vocab_argmax(pen)   # i32[B, W]
    if sample:
        p = smp.target_probs(pen, sampling)
        t = jnp.where(greedy_row[:, None], t, smp.sample_from_probs(p, u[..., 1]))
    a = _leading_true(valid & (d == t[:, :K]))
    return a, _take_row(t[..., None], a)[:, 0]


def topp_candidates(probs: jax.Array, top_p: jax.Array, max_candidate_len: int,
                    clamp: bool = False):
    """FastDeploy's ``top_p_candidates``: ``(ids i32[..., C], scores f32[..., C], len i32[...])``.

    ``probs f32[B, W, V]``, ``top_p f32[B]``. ``len`` is the smallest n whose top-n mass is
    ``>= top_p``; if never reached it is ``C`` when ``top_p >= 1`` (or ``clamp``), else 0 (as
    FastDeploy's op does).
    """
    C = max_candidate_len
    scores, ids = jax.lax.top_k(probs, C)
    cs = jnp.cumsum(scores, axis=-1)
    tp = top_p[:, None, None]
    reached = cs >= tp
    fallback = jnp.where((top_p[:, None] >= 1.0) | clamp, C, 0)
    length = jnp.where(jnp.any(reached, -1), jnp.argmax(reached, -1) + 1, fallback)
    return ids.astype(jnp.int32), scores, length.astype(jnp.int32)


def _topp(pen, d, valid, nd, sampling, u, greedy_row, C, window, clamp):
    B, W, V = pen.shape
    K = W - 1
    temp = jnp.where(greedy_row, 1.0, sampling.temperature)
    top_p = jnp.where(greedy_row, FD_GREEDY_TOP_P, sampling.top_p)
    probs = safe_softmax(smp.saturate(pen / temp[:, None, None], pen))
    ids, scores, length = topp_candidates(probs, top_p, C, clamp)              # [B,W,C],[B,W]
    c_idx = jnp.arange(C)[None, None, :]
    pos_c = scores > 0
    dK = d[..., None]
    in_set = jnp.any((c_idx < length[:, :K, None]) & (ids[:, :K] == dK) & pos_c[:, :K], axis=-1)
    top1 = (ids[:, :K, 0] == d) & pos_c[:, :K, 0]
    top2 = ((ids[:, :K, 1] == d) & pos_c[:, :K, 1]) if C >= 2 else jnp.zeros_like(top1)
    a = _leading_true(valid & in_set)
    if K > 0:
        relax = (a < nd) & _take_row(top2[..., None], a)[:, 0]
        for t in range(window):
            r = a + 1 + t
            relax = relax & (r < nd) & _take_row(top1[..., None], r)[:, 0]
        j = jnp.where(relax, a + window + 1, a)
    else:
        j = a
    sc_j, ids_j, len_j = _take_row(scores, j), _take_row(ids, j), _take_row(length[..., None], j)
    in_len = jnp.arange(C)[None, :] < len_j
    t_star = jnp.minimum(jnp.sum(jnp.where(in_len, sc_j, 0.0), -1), top_p)
    u_j = 1.0 - _take_row(u[..., 1:], j)[:, 0]                                 # (0, 1]
    hit = in_len & (jnp.cumsum(sc_j, -1) >= (u_j * t_star)[:, None])
    c = jnp.where(jnp.any(hit, -1), jnp.argmax(hit, -1), 0)
    final = jnp.take_along_axis(ids_j, c[:, None], axis=-1)[:, 0]
    return j, final


def verify(logits: jax.Array, draft_tokens: jax.Array, num_drafts: jax.Array,
           draft_probs: jax.Array | None, sampling: SamplingArrays, num_generated: jax.Array,
           eos_token_ids: jax.Array, *, strategy: str = "auto", max_candidate_len: int = 5,
           verify_window: int = 2, num_logprobs: int = 0, logprobs_mode: str = "penalized",
           truncate_at_stop: bool = True, topp_clamp_candidate_len: bool = False,
           uniforms: jax.Array | None = None) -> VerifyResult:
    """Verify the drafts of B slots against the target and emit 1..num_drafts+1 tokens per slot.

    Args:
      logits: f[B, W, V] target logits of the window rows, W = K+1 (row w = distribution of the
        token after input w). Rows past ``num_drafts`` are ignored (may hold anything finite).
      draft_tokens: i32[B, K] drafts d_1..d_K (-1 past ``num_drafts``).
      num_drafts: i32[B] drafts present per slot (0 for prefill / no drafts); clipped to [0, K].
      draft_probs: f32[B, K, V] q, the exact distribution each draft was sampled from
        (:func:`jmtp.runtime.device.sampling.draft.draft_sample`), or None for greedy drafts (one-hot q).
        A row summing to 0 also means one-hot q (a deterministic draft, e.g. n-gram). Used by
        the rejection strategy only.
      sampling: :class:`SamplingArrays` of the B slots.
      num_generated: i32[B] tokens generated before this step (min_tokens, RNG positions).
      eos_token_ids: i32[E] model EOS ids (-1 entries ignored): masked by min_tokens and treated
        as stop tokens unless the slot has ``ignore_eos``.
      strategy: static; one of :data:`jmtp.runtime.config.VERIFY_STRATEGIES` (see the module docstring).
      max_candidate_len, verify_window: static; C >= 1 (<= V) and the window W_v >= 0 of "topp".
      num_logprobs: static n >= 0; 0 = no logprobs (the result's logprob fields are None).
      logprobs_mode: static. ``"penalized"`` (default): log-softmax of the logits after penalties,
        min_tokens and bad words, before temperature / top-k / top-p / min-p. ``"raw"``: of the
        model logits. ``"final"``: log of the target distribution p (after temperature and
        filtering; -inf outside its support; greedy rows: 0 for the argmax).
      truncate_at_stop: static; cut the emitted tokens after the first stop token.
      topp_clamp_candidate_len: static; "topp" only: clamp the 0 candidate length FastDeploy
        gives when the top-C mass falls short of ``top_p`` to C.
      uniforms: optional f32[B, K+1, 2] raw draws in [0, 1) replacing the per-request ones
        (``[..., 0]``: acceptance coin of row w, ``[..., 1]``: sample at row w); for tests and
        synthetic runs. The coin used is ``1 - u`` in (0, 1].
    Returns:
      :class:`VerifyResult`.
    Raises:
      ValueError naming the argument for an unknown strategy / logprobs_mode, bad static sizes or
      mismatched shapes.
    """
    check_strategy(strategy)
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r}: must be one of {LOGPROBS_MODES}")
    if logits.ndim != 3:
        raise ValueError(f"logits: expected f[B, K+1, V], got shape {logits.shape}")
    B, W, V = logits.shape
    K = W - 1
    if draft_tokens.shape != (B, K):
        raise ValueError(f"draft_tokens: shape {draft_tokens.shape} != (B, K) = {(B, K)}")
    if num_drafts.shape != (B,) or num_generated.shape != (B,):
        raise ValueError(f"num_drafts / num_generated: shapes {num_drafts.shape}, "
                         f"{num_generated.shape} != (B,) = {(B,)}")
    if draft_probs is not None and draft_probs.shape != (B, K, V):
        raise ValueError(f"draft_probs: shape {draft_probs.shape} != (B, K, V) = {(B, K, V)}")
    if sampling.temperature.shape != (B,) or sampling.vocab_size != V:
        raise ValueError(f"sampling: arrays for B={sampling.temperature.shape[0]}, "
                         f"V={sampling.vocab_size} do not match logits (B={B}, V={V})")
    if strategy == "topp" and not 1 <= max_candidate_len <= V:
        raise ValueError(f"max_candidate_len={max_candidate_len}: must be in [1, V={V}]")
    if strategy == "topp" and verify_window < 0:
        raise ValueError(f"verify_window={verify_window}: must be >= 0")
    if uniforms is not None and uniforms.shape != (B, W, 2):
        raise ValueError(f"uniforms: shape {uniforms.shape} != (B, K+1, 2) = {(B, W, 2)}")
    if not 0 <= num_logprobs <= V:
        raise ValueError(f"num_logprobs={num_logprobs}: must be in [0, V={V}]")

    nd = jnp.clip(num_drafts.astype(jnp.int32), 0, K)
    ng = num_generated.astype(jnp.int32)
    d_raw = draft_tokens.astype(jnp.int32)
    valid = (jnp.arange(K)[None, :] < nd[:, None]) & (d_raw >= 0) & (d_raw < V)
    d = jnp.where(valid, d_raw, 0)
    pen = smp.penalize(logits, sampling, d, nd, ng, eos_token_ids)
    greedy_row = sampling.temperature < smp.GREEDY_EPS
    if strategy == "greedy":
        greedy_row = jnp.ones_like(greedy_row)

    if uniforms is not None:
        u = uniforms.astype(jnp.float32)
    elif strategy == "greedy":
        u = jnp.zeros((B, W, 2), jnp.float32)               # never read: no randomness consumed
    else:
        pos = ((ng + sampling.rng_offset)[:, None, None]
               + jnp.arange(W, dtype=jnp.int32)[None, :, None])
        purpose = jnp.array([smp.PURPOSE_ACCEPT, smp.PURPOSE_SAMPLE], jnp.int32)[None, None, :]
        u = smp.uniform_draws(sampling.seed, jnp.broadcast_to(pos, (B, W, 2)),
                              jnp.broadcast_to(purpose, (B, W, 2)), sampling.seed_hi)
    if strategy in ("auto", "rejection"):
        a, final = _rejection(pen, d, valid, nd, draft_probs, sampling, u, greedy_row)
    elif strategy in ("greedy", "target_match"):
        a, final = _match(pen, d, valid, sampling, u, greedy_row, strategy == "target_match")
    else:
        a, final = _topp(pen, d, valid, nd, sampling, u, greedy_row, max_candidate_len,
                         verify_window, topp_clamp_candidate_len)

    w = jnp.arange(W, dtype=jnp.int32)[None, :]
    d_pad = jnp.concatenate([d, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(w < a[:, None], d_pad, jnp.where(w == a[:, None], final[:, None], -1))
    num = a + 1
    if truncate_at_stop:
        sm = smp.stop_mask(sampling, eos_token_ids)
        is_stop = jnp.take_along_axis(sm, jnp.clip(tokens, 0, V - 1), axis=1) & (w < num[:, None])
        num = jnp.where(jnp.any(is_stop, 1), jnp.minimum(num, jnp.argmax(is_stop, 1) + 1), num)
        tokens = jnp.where(w < num[:, None], tokens, -1)
    result = VerifyResult(accept_tokens=tokens.astype(jnp.int32), accept_num=num.astype(jnp.int32))
    if num_logprobs == 0:
        return result
    if logprobs_mode == "raw":
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    elif logprobs_mode == "penalized":
        lp = jax.nn.log_softmax(pen, axis=-1)
    else:
        lp = jnp.log(smp.target_probs(pen, sampling))
    emitted = jnp.take_along_axis(lp, jnp.clip(tokens, 0, V - 1)[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
    return dataclasses.replace(result, logprobs=jnp.where(tokens >= 0, emitted, 0.0),
                               top_logprob_ids=top_ids.astype(jnp.int32), top_logprobs=top_lp)
