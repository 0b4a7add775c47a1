"""Gated DeltaNet: the linear-attention token mixer of hybrid models (Qwen3-Next, Qwen3.5), and its
recurrent state with one checkpoint per verify-window position.

Algorithm: the gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks",
arXiv 2412.06464), as transformers' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet`` compute
it. Per value head, with ``S f32[Dk, Dv]`` the recurrent state and row ``t``'s l2-normalised
query/key ``q_t, k_t f[Dk]`` (the query also scaled by ``Dk^-1/2``), value ``v_t f[Dv]``, decay
``g_t = -exp(A_log) · softplus(a_t + dt_bias) <= 0`` and write strength ``beta_t = sigmoid(b_t)``::

    S  <- exp(g_t) · S
    S  <- S + k_t ⊗ (beta_t · (v_t - Sᵀ k_t))        (the delta rule)
    o_t = Sᵀ q_t

The inputs ``[q; k; v]`` first pass a depthwise causal convolution of width ``conv_kernel_dim``
followed by SiLU; its state is the last ``conv_kernel_dim - 1`` inputs. The output is
``out_proj(RMSNormGated(o, z))`` with ``z = x @ lin_z`` (RMSNorm of each head, then ``· silu(z)``).

Three forms of the rule, all over fp32:

* :func:`recurrent_gated_delta_rule`: token by token over one sequence (the reference; returns the
  state after every row);
* :func:`chunk_gated_delta_rule`: chunks of ``C`` rows, the WY/UT form of Yang et al. (a unit
  lower-triangular solve per chunk, then one state update per chunk), for prefill;
* :func:`gated_delta_rule_packed`: the engine's form over a packed ragged batch: each sequence
  starts from its slot's state, and the rows that end a verify window position write one
  checkpoint each (vLLM ``gdn_attn`` / tpu-inference's "SPEC mode": K+1 state slots per request).

State pool (:class:`LinearState`, owned by the engine next to the KV cache): per linear layer and
slot, ``W = K+1`` checkpoints of the convolution and recurrent state, and per slot the checkpoint
it continues from (``current``). A step's last ``min(q, W)`` rows of a slot with ``q`` rows write
checkpoints ``W - q + local``; after verification the slot continues from the checkpoint of its
last committed row (:func:`next_checkpoint`), so a rejection costs no recompute. A slot whose first
row sits at position 0 starts from the zero state (a new or re-prefilled request: nothing of a
previous occupant can leak).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jmtp.model.config import LinearAttentionConfig, ModelConfig


class LinearState(NamedTuple):
    """Recurrent state pool of a hybrid model's linear-attention layers.

    Attributes:
      conv: ``f[Ll, B, W, conv_kernel_dim - 1, conv_dim]``: per linear layer, slot and
        checkpoint, the last inputs of the causal convolution (oldest first), channels
        ``[q; k; v]``.
      recurrent: ``f32[Ll, B, W, Hv, Dk, Dv]``: the delta-rule state of every value head.
      current: ``i32[B]``: the checkpoint each slot continues from.
      saved: with prefix caching, the block-boundary state checkpoints
        (:class:`jmtp.model.state_checkpoints.StateCheckpoints`); else None.
    """

    conv: jax.Array
    recurrent: jax.Array
    current: jax.Array
    saved: "StateCheckpoints | None" = None   # noqa: F821 (jmtp.model.state_checkpoints)

    def nbytes(self) -> int:
        """Bytes of the pool (the state checkpoints of prefix caching included)."""
        return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(self))


def init_linear_state(cfg: ModelConfig, num_slots: int, window: int,
                      dtype=jnp.float32, num_saved: int = 0) -> LinearState | None:
    """Zero state pool for ``num_slots`` slots with ``window`` (= K+1) checkpoints each; None for a
    model without linear-attention layers. ``dtype``: the convolution state's (the model's); the
    recurrent state is always fp32 (transformers keeps it in fp32 too). ``num_saved > 0``: also
    that many block-boundary state checkpoints for prefix caching
    (:func:`jmtp.model.state_checkpoints.init_state_checkpoints`)."""
    if not cfg.is_hybrid:
        return None
    lc, n = cfg.linear, len(cfg.linear_layers)
    saved = None
    if num_saved:
        from jmtp.model.state_checkpoints import init_state_checkpoints
        saved = init_state_checkpoints(cfg, num_slots, num_saved, dtype)
    return LinearState(
        conv=jnp.zeros((n, num_slots, window, lc.conv_kernel_dim - 1, lc.conv_dim), dtype),
        recurrent=jnp.zeros((n, num_slots, window, lc.num_value_heads, lc.key_head_dim,
                             lc.value_head_dim), jnp.float32),
        current=jnp.zeros((num_slots,), jnp.int32), saved=saved)


def next_checkpoint(current: jax.Array, query_lens: jax.Array, num_committed: jax.Array,
                    prefilling: jax.Array, window: int) -> jax.Array:
    """``i32[B]``: the checkpoint each slot continues from after a step.

    A slot with ``q > 0`` rows wrote checkpoints ``W - q + local`` for its last ``min(q, W)``
    rows. A prefill chunk continues from its last row (``W - 1``); a verify window of ``q`` rows
    that committed ``n`` tokens consumed its first ``n`` rows (the last accepted token and the
    ``n - 1`` accepted drafts; the bonus token is the next window's first row), so it continues
    from ``W - q + n - 1``. Idle and paused slots (``q = 0``) keep theirs."""
    decode = jnp.clip(window - query_lens + num_committed - 1, 0, window - 1)
    nxt = jnp.where(prefilling, window - 1, decode)
    return jnp.where(query_lens > 0, nxt, current).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------
# Pieces of the layer
# ------------------------------------------------------------------------------------------------

def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x²) + eps)`` over the last axis (FLA's / transformers' ``l2norm``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare_qk(q: jax.Array, k: jax.Array, num_value_heads: int) -> tuple[jax.Array, jax.Array]:
    """``q, k f[T, Hk, Dk]`` -> fp32 ``f32[T, Hv, Dk]``: each key head repeated for its value heads,
    l2-normalised, the query scaled by ``Dk^-1/2`` (the ``use_qk_l2norm_in_kernel`` path)."""
    rep = num_value_heads // q.shape[1]
    q, k = (jnp.repeat(a.astype(jnp.float32), rep, axis=1) for a in (q, k))
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


def decay_and_beta(p: dict, a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``g = -exp(A_log) · softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, fp32 ``[T, Hv]``."""
    g = -jnp.exp(p["a_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def gated_rms_norm(o: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """transformers ``Qwen3NextRMSNormGated``: ``w · rms(o) · silu(z)`` per head (the RMS over the
    last axis in fp32; ``w`` applied in ``o``'s dtype). ``o, z f[..., Dv]``, ``w f[Dv]``."""
    of = o.astype(jnp.float32)
    y = (of * jax.lax.rsqrt(jnp.mean(of * of, -1, keepdims=True) + eps)).astype(o.dtype)
    return ((w * y).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


def causal_conv1d(x: jax.Array, w: jax.Array, state: jax.Array | None = None) -> jax.Array:
    """Depthwise causal convolution of one sequence, then SiLU.

    Args:
      x: ``f[T, C]`` inputs.
      w: ``f[Kc, C]`` taps, the last one applied to the current row (transformers'
        ``conv1d.weight[c, 0, :]`` transposed).
      state: ``f[Kc-1, C]`` the inputs before ``x`` (oldest first); None = zeros.

    Returns:
      ``f[T, C]``."""
    kc = w.shape[0]
    if state is None:
        state = jnp.zeros((kc - 1, x.shape[1]), x.dtype)
    full = jnp.concatenate([state.astype(x.dtype), x], 0).astype(jnp.float32)
    t = x.shape[0]
    out = sum(full[j:j + t] * w[j].astype(jnp.float32) for j in range(kc))
    return jax.nn.silu(out).astype(x.dtype)


# ------------------------------------------------------------------------------------------------
# The rule: recurrent, chunked and packed forms
# ------------------------------------------------------------------------------------------------

def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """Token-by-token gated delta rule over one sequence (the reference).

    Args:
      q, k: ``f32[T, H, Dk]`` prepared (:func:`prepare_qk`). v: ``f32[T, H, Dv]``.
      g, beta: ``f32[T, H]``. initial_state: ``f32[H, Dk, Dv]`` or None (zeros).

    Returns:
      ``(o f32[T, H, Dv], states f32[T, H, Dk, Dv])``: the output and the state after every row.
    """
    h, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    s0 = jnp.zeros((h, dk, dv), jnp.float32) if initial_state is None else initial_state

    def step(s, inp):
        s = delta_rule_step(s, *inp)
        return s, (jnp.einsum("hkv,hk->hv", s, inp[0]), s)

    _, (o, states) = jax.lax.scan(step, s0.astype(jnp.float32), (q, k, v, g, beta))
    return o, states


def delta_rule_step(s, q, k, v, g, beta):
    """One row of the rule: ``s f32[H, Dk, Dv]`` and row inputs ``q, k f32[H, Dk]``,
    ``v f32[H, Dv]``, ``g, beta f32[H]`` -> the new state (``q`` unused: the output is read by the
    caller)."""
    del q
    s = s * jnp.exp(g)[:, None, None]
    delta = (v - jnp.einsum("hkv,hk->hv", s, k)) * beta[:, None]
    return s + k[:, :, None] * delta[:, None, :]


def _chunk_step(s, q, k, v, g, beta):
    """One chunk of the WY/UT form: state ``s f32[H, Dk, Dv]`` and the chunk's rows
    ``q, k f32[C, H, Dk]``, ``v f32[C, H, Dv]``, ``g, beta f32[C, H]`` -> ``(s, o f32[C, H, Dv])``.
    Rows with ``g = beta = 0`` and ``k = 0`` leave the state unchanged (chunk padding)."""
    c = q.shape[0]
    q, k, v = (a.transpose(1, 0, 2) for a in (q, k, v))               # [H, C, D]
    g, beta = g.T, beta.T                                               # [H, C]
    gc = jnp.cumsum(g, axis=-1)
    causal = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    diff = gc[:, :, None] - gc[:, None, :]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)   # [H, C, C]
    kb, vb = k * beta[..., None], v * beta[..., None]
    a_mat = jnp.where(strict, jnp.einsum("hik,hjk->hij", kb, k) * decay, 0.0)
    # (I + A) x = rhs, A strictly lower: the UT transform
    eye = jnp.eye(c, dtype=jnp.float32)
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(  # noqa: E731
        eye + a_mat, rhs, lower=True, unit_diagonal=True)
    u = solve(vb)                                                       # new values
    w = solve(kb * jnp.exp(gc)[..., None])                              # decayed keys
    attn = jnp.where(causal, jnp.einsum("hik,hjk->hij", q, k) * decay, 0.0)
    v_new = u - jnp.einsum("hck,hkv->hcv", w, s)
    o = (jnp.einsum("hck,hkv->hcv", q * jnp.exp(gc)[..., None], s)
         + jnp.einsum("hcj,hjv->hcv", attn, v_new))
    k_dec = k * jnp.exp(gc[:, -1:] - gc)[..., None]
    s = s * jnp.exp(gc[:, -1])[:, None, None] + jnp.einsum("hck,hcv->hkv", k_dec, v_new)
    return s, o.transpose(1, 0, 2)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """Chunked gated delta rule over one sequence (Yang et al. 2024's WY/UT form, as FLA's
    ``chunk_gated_delta_rule`` and transformers' ``torch_chunk_gated_delta_rule``): within a chunk
    of ``C`` rows the delta-rule updates are folded into one unit lower-triangular solve, and the
    state advances once per chunk. Same arguments as :func:`recurrent_gated_delta_rule`.

    Returns:
      ``(o f32[T, H, Dv], final_state f32[H, Dk, Dv])``.
    """
    t, h, dk = k.shape
    dv = v.shape[2]
    c = chunk_size
    pad = (-t) % c
    padt = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
    q, k, v, g, beta = (padt(a.astype(jnp.float32)) for a in (q, k, v, g, beta))
    n = (t + pad) // c
    chunks = [a.reshape((n, c) + a.shape[1:]) for a in (q, k, v, g, beta)]
    s0 = (jnp.zeros((h, dk, dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    s, o = jax.lax.scan(lambda s, x: _chunk_step(s, *x), s0, chunks)
    return o.reshape(n * c, h, dv)[:t], s


def gated_delta_rule_packed(q, k, v, g, beta, row_seq, row_start, row_ckpt, init, pool,
                            pool_base=0):
    """The rule over a packed ragged batch, writing one state checkpoint per marked row (the
    engine's form; :mod:`jmtp.pallas.gated_delta_rule` holds the Pallas kernels of the same
    contract).

    Args:
      q, k: ``f32[T, Hv, Dk]`` prepared (:func:`prepare_qk`); v: ``f32[T, Hv, Dv]``;
        g, beta: ``f32[T, Hv]``.
      row_seq: ``i32[T]`` slot of each row (rows of a slot are contiguous).
      row_start: ``bool[T]``: the row is its slot's first of this step (the state is reloaded
        from ``init``).
      row_ckpt: ``i32[T]``: checkpoint the state after this row is written to, -1 = none
        (padding rows: -1 and any ``row_seq``).
      init: ``f32[B, Hv, Dk, Dv]`` each slot's state before this step.
      pool: ``f32[N, W, Hv, Dk, Dv]`` the checkpoints, updated: slot ``s`` writes entry
        ``pool_base + s`` (``N >= pool_base + B``; the engine passes every linear layer's pool
        as one flat view, layer ``j`` at ``pool_base = j·B``, so no layer is sliced out).
      pool_base: ``int`` or ``i32[]``.

    Returns:
      ``(o f32[T, Hv, Dv], pool)``.
    """
    w = pool.shape[1]

    def step(carry, inp):
        s, pool = carry
        qt, kt, vt, gt, bt, seq, start, ck = inp
        s = jnp.where(start, init[seq], s)
        s = delta_rule_step(s, qt, kt, vt, gt, bt)
        o = jnp.einsum("hkv,hk->hv", s, qt)
        # an unmarked row writes nowhere (an out-of-range entry, dropped): no read of the old
        # checkpoint, so the pool is updated in place
        e = jnp.where(ck >= 0, pool_base + seq, pool.shape[0])
        pool = pool.at[e, jnp.clip(ck, 0, w - 1)].set(s, mode="drop")
        return (s, pool), o

    s0 = jnp.zeros(init.shape[1:], jnp.float32)
    (_, pool), o = jax.lax.scan(step, (s0, pool), (q, k, v, g, beta, row_seq, row_start, row_ckpt))
    return o, pool


def chunk_gated_delta_rule_varlen(q, k, v, g, beta, chunk_seq, chunk_first, chunk_last, init):
    """The chunked WY/UT form over several slots laid out chunk-aligned (the engine's prefill
    form; :mod:`jmtp.pallas.gated_delta_rule` and :mod:`jmtp.pallas.gated_delta_rule_gpu` hold
    kernels of the same contract).

    Args:
      q, k: ``f32[n·C, Hv, Dk]`` prepared; v: ``f32[n·C, Hv, Dv]``; g, beta: ``f32[n·C, Hv]``:
        ``n`` chunks of ``C`` rows, each slot's rows starting at a chunk boundary; rows that
        belong to no slot are zero (``g = beta = 0``, ``k = 0``: they leave the state unchanged).
      chunk_seq: ``i32[n]`` slot of each chunk (chunks of a slot contiguous, slots in increasing
        order; chunks of no slot after them).
      chunk_first: ``bool[n]`` the chunk is its slot's first: the state is loaded from
        ``init[seq]``.
      chunk_last: ``bool[n]`` the chunk is its slot's last: the state after it is the slot's
        final state.
      init: ``f32[B, Hv, Dk, Dv]`` each slot's state before the step.

    Returns:
      ``(o f32[n·C, Hv, Dv], final f32[B, Hv, Dk, Dv])``: ``final[s]`` the state after slot
      ``s``'s last chunk (unspecified for a slot without chunks); rows of chunks that are no
      slot's are unspecified.
    """
    n = chunk_seq.shape[0]
    xs = [a.astype(jnp.float32).reshape((n, -1) + a.shape[1:]) for a in (q, k, v, g, beta)]

    def step(carry, x):
        st, final = carry
        sq, fi, la, *rowsx = x
        st = jnp.where(fi, init[sq].astype(jnp.float32), st)
        st, oc = _chunk_step(st, *rowsx)
        final = jax.lax.dynamic_update_slice(
            final, jnp.where(la, st, final[sq])[None], (sq, 0, 0, 0))
        return (st, final), oc

    zero = jnp.zeros(init.shape[1:], jnp.float32)
    (_, final), oc = jax.lax.scan(step, (zero, jnp.zeros(init.shape, jnp.float32)),
                                  (chunk_seq, chunk_first, chunk_last, *xs))
    return oc.reshape((-1,) + oc.shape[2:]), final


def gated_delta_rule_mixed(q, k, v, g, beta, rows: "PackedRows", init, pool, rule=None,
                           chunk_size: int = 64, pool_base=0, chunk_rule=None):
    """The engine's rule over a packed step: the rows of verify windows and short chunks (slots
    with ``q <= W`` rows) by the recurrent packed rule with one checkpoint per row
    (:func:`gated_delta_rule_packed`, or ``rule``), compacted to at most ``B·W`` rows; the rows of
    longer prefill chunks (``q > W``) by the chunked WY/UT form over chunk-aligned slots
    (:func:`chunk_gated_delta_rule_varlen`, or ``chunk_rule``), each slot's rows laid out from a
    chunk boundary, its final state written to checkpoint ``W - 1`` (what
    :func:`next_checkpoint` continues a prefill from). The chunked part runs only in a step that
    has such a slot (``lax.cond``).

    Args:
      q, k, v, g, beta, init, pool, pool_base: as :func:`gated_delta_rule_packed`.
      rows: :func:`packed_rows` of the step (its ``q_lens``: rows per slot).
      chunk_size: C, rows per chunk of the chunked form.

    Returns:
      ``(o f32[T, Hv, Dv], pool)``.
    """
    from jmtp.core.mesh import uniform_any
    t = q.shape[0]
    b_slots, w = init.shape[0], pool.shape[1]
    q_lens = rows.q_lens
    long_seq = q_lens > w
    row_long = long_seq[rows.seq] & rows.valid
    # -- recurrent part: the other rows, in order, compacted to R <= B·W rows
    r = min(t, b_slots * w)
    idx = jnp.nonzero(rows.valid & ~row_long, size=r, fill_value=t)[0]
    real = idx < t
    src = jnp.minimum(idx, t - 1)
    take = lambda a: a[src]  # noqa: E731
    o_r, pool = (rule or gated_delta_rule_packed)(
        take(q), take(k), take(v), take(g), take(beta), rows.seq[src],
        real & (rows.local[src] == 0), jnp.where(real, rows.ckpt[src], -1), init, pool,
        pool_base=pool_base)
    o = jnp.zeros(v.shape, jnp.float32).at[idx].set(o_r, mode="drop")
    if t <= w:          # (a bucket of at most W rows holds no long chunk)
        return o, pool

    # -- chunked part: slot s's rows from chunk cs[s], row `local` at chunk cs + local // C
    # a power of two >= 8 rows (a Mosaic sublane tile; a Triton block shape)
    c = max(1, min(chunk_size, 1 << max(3, (t - 1).bit_length())))
    n_chunks = -(-t // c) + min(b_slots, t // (w + 1))
    per = jnp.where(long_seq, -(-q_lens // c), 0)
    cs = jnp.cumsum(per) - per                                          # first chunk per slot
    aligned = jnp.where(row_long, (cs[rows.seq] + rows.local // c) * c + rows.local % c,
                        n_chunks * c)

    def chunked(ops):
        lay = lambda a: jnp.zeros((n_chunks * c,) + a.shape[1:], jnp.float32).at[aligned].set(  # noqa: E731
            a.astype(jnp.float32), mode="drop")
        ci = jnp.arange(n_chunks, dtype=jnp.int32)
        end = cs + per
        seq = jnp.clip(jnp.searchsorted(end, ci, side="right"), 0, b_slots - 1).astype(jnp.int32)
        valid = ci < end[seq]
        oc, final = (chunk_rule or chunk_gated_delta_rule_varlen)(
            *(lay(a) for a in ops[:5]), seq, valid & (ci == cs[seq]),
            valid & (ci == end[seq] - 1), ops[5])
        return oc[jnp.minimum(aligned, n_chunks * c - 1)], final

    # The cond carries only this layer's rows and B states (not the pool: a conditional's
    # result is a new buffer, so the pool would be copied whole); the final states of the long
    # slots are then scattered into checkpoint W - 1 in place.
    skip = lambda ops: (jnp.zeros(v.shape, jnp.float32), ops[5])  # noqa: E731
    oc, final = jax.lax.cond(uniform_any(long_seq), chunked, skip, (q, k, v, g, beta, init))
    o = jnp.where(row_long[:, None, None], oc, o)
    dst = jnp.where(long_seq, pool_base + jnp.arange(b_slots), pool.shape[0])
    pool = pool.at[dst, w - 1].set(final, mode="drop")
    return o, pool


# ------------------------------------------------------------------------------------------------
# The layer over a packed batch (engine) and over one sequence (reference / tests)
# ------------------------------------------------------------------------------------------------

class PackedRows(NamedTuple):
    """Row addressing of a packed step for the linear layers (:func:`packed_rows`), computed once
    per step and shared by every linear layer.

    Attributes:
      seq: ``i32[T]`` slot of each row; local: ``i32[T]`` its index within the slot's rows;
      valid: ``bool[T]`` not padding; fresh: ``bool[T]`` the slot starts from the zero state
      (its first row is at position 0); ckpt: ``i32[T]`` checkpoint written after the row, -1 none;
      q_lens: ``i32[B]`` rows per slot; fresh_seq: ``bool[B]`` the slot has rows and starts from
      the zero state.
    """

    seq: jax.Array
    local: jax.Array
    valid: jax.Array
    fresh: jax.Array
    ckpt: jax.Array
    q_lens: jax.Array
    fresh_seq: jax.Array


def packed_rows(cu_q_lens: jax.Array, positions: jax.Array, window: int) -> PackedRows:
    """:class:`PackedRows` of a packed batch (``cu_q_lens i32[B+1]``, ``positions i32[T]``): the
    last ``min(q, W)`` rows of a slot with ``q`` rows write checkpoints ``W - q + local``."""
    from jmtp.model.metadata import packed_row_seq
    t = positions.shape[0]
    seq, local = packed_row_seq(cu_q_lens, t)
    valid = jnp.arange(t, dtype=jnp.int32) < cu_q_lens[-1]
    q_lens = (cu_q_lens[1:] - cu_q_lens[:-1]).astype(jnp.int32)
    q = q_lens[seq]
    ck = window - q + local
    ckpt = jnp.where(valid & (ck >= 0), ck, -1).astype(jnp.int32)
    fresh = (positions - local) == 0
    first = positions[jnp.clip(cu_q_lens[:-1], 0, max(t - 1, 0))]
    fresh_seq = (q_lens > 0) & (first == 0)
    return PackedRows(seq, local, valid, fresh, ckpt, q_lens, fresh_seq)


def _project(lc: LinearAttentionConfig, p: dict, h: jax.Array):
    """Input projections of normed rows ``h f[T, H]``: ``(qkv f[T, conv_dim], z, a, b)``."""
    qkv = jnp.concatenate([h @ p["lin_q"], h @ p["lin_k"], h @ p["lin_v"]], -1)
    return qkv, h @ p["lin_z"], h @ p["lin_a"], h @ p["lin_b"]


def _conv_weight(p: dict) -> jax.Array:
    return jnp.concatenate([p["conv_q"], p["conv_k"], p["conv_v"]], -1)      # f[Kc, conv_dim]


def _output(cfg: ModelConfig, p: dict, o: jax.Array, z: jax.Array, dtype) -> jax.Array:
    lc = cfg.linear
    t = o.shape[0]
    z = z.reshape(t, lc.num_value_heads, lc.value_head_dim)
    y = gated_rms_norm(o.astype(dtype), z, p["lin_norm"], cfg.rms_norm_eps)
    return y.reshape(t, lc.value_dim) @ p["lin_out"]


def _split_qkv(lc: LinearAttentionConfig, x: jax.Array):
    t = x.shape[0]
    q = x[:, :lc.key_dim].reshape(t, lc.num_key_heads, lc.key_head_dim)
    k = x[:, lc.key_dim:2 * lc.key_dim].reshape(t, lc.num_key_heads, lc.key_head_dim)
    v = x[:, 2 * lc.key_dim:].reshape(t, lc.num_value_heads, lc.value_head_dim)
    return q, k, v


def linear_attention_packed(cfg: ModelConfig, p: dict, h: jax.Array, rows: PackedRows,
                            conv_pool: jax.Array, rec_pool: jax.Array, current: jax.Array,
                            rule=None, chunk_size: int = 64, layer=0, chunk_rule=None):
    """A gated-DeltaNet token mixer over a packed batch, reading each slot's state at its
    ``current`` checkpoint and writing the checkpoints of :func:`packed_rows`.

    Args:
      h: ``f[T, H]`` the normed rows (after ``attn_norm``).
      conv_pool: ``f[N, W, Kc-1, conv_dim]``; rec_pool: ``f32[N, W, Hv, Dk, Dv]``: this layer's
        pool (``N = B``, ``layer = 0``) or every linear layer's pool as one flat view (``N =
        Ll·B``, a reshape of ``LinearState``'s arrays), this layer's slot ``b`` at entry
        ``layer·B + b``: the pools are updated in place, no layer is sliced out and written back.
      current: ``i32[B]``.
      rule: the packed recurrent rule of window rows (default :func:`gated_delta_rule_packed`; a
        kernel of the same contract may be passed); longer prefill chunks take the chunked form
        (:func:`chunk_gated_delta_rule_varlen` or ``chunk_rule``, ``chunk_size`` rows per chunk).
      layer: ``int``, the layer's index among the linear layers.

    Returns:
      ``(out f[T, H], conv_pool, rec_pool)``.
    """
    lc = cfg.linear
    kc = lc.conv_kernel_dim
    b_slots, w = current.shape[0], rec_pool.shape[1]
    base = layer * b_slots
    t = h.shape[0]
    qkv, z, a, b = _project(lc, p, h)
    seq, local = rows.seq, rows.local
    bidx = base + jnp.arange(b_slots)
    conv_in = conv_pool[bidx, current]                                  # f[B, Kc-1, C]
    conv_in = jnp.where(rows.fresh_seq[:, None, None], 0, conv_in)
    # The convolution window of row t: inputs t-Kc+1 .. t (the slot's own earlier rows of this
    # step, else its convolution state).
    tr = jnp.arange(t, dtype=jnp.int32)

    def tap(i):   # the input i rows back (i = 0: the row itself)
        own = qkv[jnp.clip(tr - i, 0, t - 1)]
        back = conv_in[seq, jnp.clip(kc - 1 - (i - local), 0, kc - 2)]
        return jnp.where((local >= i)[:, None], own, back.astype(qkv.dtype))

    taps = [tap(i) for i in range(kc)]                    # taps[i]: i rows back
    wconv = _conv_weight(p).astype(jnp.float32)
    conv = sum(taps[i].astype(jnp.float32) * wconv[kc - 1 - i] for i in range(kc))
    x = jax.nn.silu(conv).astype(h.dtype)
    # conv checkpoints: the last Kc-1 inputs up to row t, oldest first
    new_conv = jnp.stack([taps[kc - 2 - j] for j in range(kc - 1)], 1)   # f[T, Kc-1, C]
    ck = rows.ckpt
    conv_pool = conv_pool.at[jnp.where(ck >= 0, base + seq, conv_pool.shape[0]),
                             jnp.clip(ck, 0, w - 1)].set(new_conv.astype(conv_pool.dtype),
                                                         mode="drop")

    q, k, v = _split_qkv(lc, x)
    q, k = prepare_qk(q, k, lc.num_value_heads)
    g, beta = decay_and_beta(p, a, b)
    init = rec_pool[bidx, current]
    init = jnp.where(rows.fresh_seq[:, None, None, None], 0.0, init)
    o, rec_pool = gated_delta_rule_mixed(q, k, v.astype(jnp.float32), g, beta, rows, init,
                                         rec_pool, rule, chunk_size, base, chunk_rule)
    return _output(cfg, p, o, z, h.dtype), conv_pool, rec_pool


def linear_attention_sequence(cfg: ModelConfig, p: dict, h: jax.Array, conv_state=None,
                              rec_state=None, chunk_size: int | None = 64):
    """The token mixer over one whole sequence ``h f[T, H]`` (normed rows): the chunked rule
    (``chunk_size``), or the recurrent one with ``chunk_size=None``. Returns
    ``(out f[T, H], conv_state f[Kc-1, conv_dim], rec_state f32[Hv, Dk, Dv])``: the states after
    the last row."""
    lc = cfg.linear
    kc = lc.conv_kernel_dim
    qkv, z, a, b = _project(lc, p, h)
    x = causal_conv1d(qkv, _conv_weight(p), conv_state)
    prev = (jnp.zeros((kc - 1, lc.conv_dim), qkv.dtype) if conv_state is None
            else conv_state.astype(qkv.dtype))
    new_conv = jnp.concatenate([prev, qkv], 0)[-(kc - 1):]
    q, k, v = _split_qkv(lc, x)
    q, k = prepare_qk(q, k, lc.num_value_heads)
    g, beta = decay_and_beta(p, a, b)
    if chunk_size is None:
        o, states = recurrent_gated_delta_rule(q, k, v.astype(jnp.float32), g, beta, rec_state)
        s = states[-1]
    else:
        o, s = chunk_gated_delta_rule(q, k, v.astype(jnp.float32), g, beta, rec_state, chunk_size)
    return _output(cfg, p, o, z, h.dtype), new_conv, s
