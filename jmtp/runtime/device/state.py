"""Fixed-shape engine state: one pytree of per-slot device arrays (FastDeploy ``share_inputs`` analog).

Every array has a static shape derived from :class:`~jmtp.runtime.config.EngineConfig` (B slots,
window K+1, Lbuf = max_model_len + K + 1 token buffer, P block-table pages, N blocks), so the jitted
engine step never recompiles for new requests. Field names follow FastDeploy's; where the meaning
differs it is said.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jmtp.pallas.block_allocator import BlockAllocatorState
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.sampling import SamplingArrays

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_REASONS = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EngineState:
    """Per-slot serving state (a pytree; every field is data, none static: the static shape lives
    in EngineConfig).

    Sequence bookkeeping:
      input_ids: i32[B, Lbuf]        prompt tokens followed by generated tokens. (FastDeploy splits
                                     these into ``input_ids`` and ``pre_ids``; here
                                     ``pre_ids[k]`` (1-based) == ``input_ids[prompt_lens + k - 1]``.)
      prompt_lens: i32[B]            L_b, prompt length.
      seq_lens_encoder: i32[B]       prompt tokens prefilled in the last step (0: decode or idle).
      seq_lens_decoder: i32[B]       tokens already in the target KV cache = start position of this
                                     step's queries. In decode: ``prompt_lens + step_idx - 1``.
      seq_lens_this_time: i32[B]     query tokens of the last step (prefill chunk, or 1 + #drafts).
      step_idx: i32[B]               tokens generated so far.
      draft_tokens: i32[B, K+1]      next verify window ``[last accepted token, d1..dK]``, -1 = none.
      accept_tokens: i32[B, K+1]     tokens emitted by the last step (accepted drafts + bonus).
      accept_num: i32[B]             valid entries of accept_tokens (0 for idle / mid-prefill slots).
      num_drafts: i32[B]             drafts verified in the last step (for metrics).
      actual_draft_token_num: i32[B] drafts the pending window was allowed when it was proposed
                                     (the step's draft budget: K, the dynamic policy's limit, the
                                     ``max_tokens`` / ``max_model_len`` caps); ``draft_tokens``
                                     holds at most that many, an n-gram or hybrid window may hold
                                     fewer (no match). FastDeploy's per-slot adaptive budget of
                                     the same name; here the host's policy sets the budget.
      draft_probs: f32[B, K, V] | None  distribution each pending draft was sampled from (only
                                     with ``draft_sampling``; None means greedy one-hot drafts).
    Limits and stopping:
      max_dec_len: i32[B]            max new tokens (SamplingParams.max_tokens).
      sampling: SamplingArrays       per-slot sampling parameters, stop ids (EOS included unless
                                     ignore_eos), min_tokens, penalty histories.
      stop_flags: bool[B]            slot idle or finished (init True).
      finish_reason: i32[B]          FINISH_NONE / FINISH_STOP / FINISH_LENGTH.
    KV blocks (shared ids for the target and MTP caches):
      blocks: BlockAllocatorState    ``free_stack i32[N]``, ``free_count i32[]``,
                                     ``block_tables i32[B, P]`` (physical block of each logical
                                     block, -1 = absent), ``num_owned i32[B]``; read-only
                                     shortcuts ``state.free_count`` etc. are properties.
      paused: bool[B]                slot could not get its blocks this step (``is_block_step``).
    Prefix caching (``EngineConfig.enable_prefix_caching``; both None when it is off):
      num_shared: i32[B] | None      read-only cached blocks at the front of the slot's sequence:
                                     logical pages ``[0, num_shared)`` live in ``shared_tables``,
                                     page ``num_shared + j`` in the owned block
                                     ``block_tables[b, j]`` (:func:`effective_block_tables`).
      shared_tables: i32[B, P] | None  physical ids of the shared pages, -1 past ``num_shared``.
                                     The allocator never sees them: they are not owned and no
                                     step writes positions below ``num_shared * block_size``.
    """

    input_ids: jax.Array
    prompt_lens: jax.Array
    seq_lens_encoder: jax.Array
    seq_lens_decoder: jax.Array
    seq_lens_this_time: jax.Array
    step_idx: jax.Array
    draft_tokens: jax.Array
    accept_tokens: jax.Array
    accept_num: jax.Array
    num_drafts: jax.Array
    actual_draft_token_num: jax.Array
    draft_probs: jax.Array | None
    max_dec_len: jax.Array
    sampling: SamplingArrays
    stop_flags: jax.Array
    finish_reason: jax.Array
    blocks: BlockAllocatorState
    paused: jax.Array
    num_shared: jax.Array | None = None
    shared_tables: jax.Array | None = None

    @property
    def free_stack(self) -> jax.Array:
        return self.blocks.free_stack

    @property
    def free_count(self) -> jax.Array:
        return self.blocks.free_count

    @property
    def block_tables(self) -> jax.Array:
        return self.blocks.block_tables

    @property
    def num_owned(self) -> jax.Array:
        return self.blocks.num_owned


def init_state(ec: EngineConfig, vocab_size: int) -> EngineState:
    """All slots idle, every block free."""
    b, w = ec.max_num_seqs, ec.window
    zi = lambda *s: jnp.zeros(s, jnp.int32)
    return EngineState(
        input_ids=zi(b, ec.seq_buffer_len),
        prompt_lens=zi(b),
        seq_lens_encoder=zi(b),
        seq_lens_decoder=zi(b),
        seq_lens_this_time=zi(b),
        step_idx=zi(b),
        draft_tokens=jnp.full((b, w), -1, jnp.int32),
        accept_tokens=jnp.full((b, w), -1, jnp.int32),
        accept_num=zi(b),
        num_drafts=zi(b),
        actual_draft_token_num=zi(b),
        draft_probs=(jnp.zeros((b, ec.k, vocab_size), jnp.float32) if ec.spec.draft_sampling else None),
        max_dec_len=zi(b),
        sampling=SamplingArrays.empty(b, vocab_size, ec.max_stop_ids, ec.max_bad_words,
                                      ec.max_bad_word_len, ec.max_logit_bias),
        stop_flags=jnp.ones((b,), bool),
        finish_reason=zi(b),
        blocks=BlockAllocatorState.create(ec.num_blocks, b, ec.pages_per_seq),
        paused=jnp.zeros((b,), bool),
        num_shared=zi(b) if ec.enable_prefix_caching else None,
        shared_tables=(jnp.full((b, ec.pages_per_seq), -1, jnp.int32)
                       if ec.enable_prefix_caching else None),
    )


def effective_block_tables(state: EngineState, block_tables: jax.Array | None = None
                           ) -> jax.Array:
    """``i32[B, P]``: the physical block of every logical page of every slot, shared prefix
    pages first (``shared_tables[b, :num_shared[b]]``), then the owned blocks
    (``block_tables[b, :num_owned[b]]``), -1 past them. Without prefix caching this is the
    allocator's table itself. ``block_tables`` overrides the state's owned table (the step passes
    the one after this step's top-up)."""
    owned = state.block_tables if block_tables is None else block_tables
    if state.num_shared is None:
        return owned
    p = owned.shape[1]
    j = jnp.arange(p, dtype=jnp.int32)[None, :]
    ns = state.num_shared[:, None]
    from_owned = jnp.take_along_axis(owned, jnp.clip(j - ns, 0, p - 1), axis=1)
    return jnp.where(j < ns, state.shared_tables, jnp.where(j - ns < p, from_owned, -1))


def insert_request(
    state: EngineState,
    slot: jax.Array,          # i32[]   an idle slot (stop_flags True, owns no blocks)
    prompt: jax.Array,        # i32[Lbuf] prompt tokens, padded
    prompt_len: jax.Array,    # i32[]
    max_dec_len: jax.Array,   # i32[]
    sampling_row: dict,       # one row of SamplingArrays (jmtp.runtime.host.sampling_rows.make_row)
    resume_token: jax.Array | int = -1,   # i32[] see below; -1 = a new request
    shared_blocks: jax.Array | None = None,  # i32[P] cached prefix blocks, -1 padded
    num_shared: jax.Array | int = 0,         # i32[] valid entries of shared_blocks
    cached_len: jax.Array | int = 0,         # i32[] num_shared * block_size
) -> EngineState:
    """Put a new request into ``slot`` (every per-slot field reset; nothing leaks from the last
    occupant). Its blocks are allocated by the next engine step.

    ``resume_token >= 0`` re-admits a preempted request: ``prompt`` is its prompt plus all but the
    last generated token, and ``resume_token`` is that last token. It waits in
    ``draft_tokens[slot, 0]`` (the window's "last token") and the step that finishes the prefill
    emits it instead of sampling, so the next verify window starts where the preempted one did.

    With prefix caching, ``shared_blocks[:num_shared]`` are cached blocks holding the target and
    MTP KV of the prompt's first ``num_shared * block_size`` positions: the slot reads them
    (read-only) and its prefill starts after them (``seq_lens_decoder = cached_len = num_shared *
    block_size``, which must stay below ``prompt_len``; the host checks both)."""
    s = state
    upd = lambda a, v: a.at[slot].set(v)
    extra = {}
    if s.num_shared is not None:
        p = s.shared_tables.shape[1]
        row = (jnp.full((p,), -1, jnp.int32) if shared_blocks is None
               else jnp.where(jnp.arange(p) < num_shared, shared_blocks, -1))
        extra = dict(num_shared=upd(s.num_shared, num_shared),
                     shared_tables=upd(s.shared_tables, row))
    cached = 0 if s.num_shared is None else cached_len
    return dataclasses.replace(
        s,
        input_ids=upd(s.input_ids, prompt),
        prompt_lens=upd(s.prompt_lens, prompt_len),
        seq_lens_encoder=upd(s.seq_lens_encoder, 0),
        seq_lens_decoder=upd(s.seq_lens_decoder, cached),
        seq_lens_this_time=upd(s.seq_lens_this_time, 0),
        step_idx=upd(s.step_idx, 0),
        draft_tokens=upd(s.draft_tokens, jnp.full((s.draft_tokens.shape[1],), -1, jnp.int32)
                         .at[0].set(resume_token)),
        accept_tokens=upd(s.accept_tokens, -1),
        accept_num=upd(s.accept_num, 0),
        num_drafts=upd(s.num_drafts, 0),
        actual_draft_token_num=upd(s.actual_draft_token_num, 0),
        max_dec_len=upd(s.max_dec_len, max_dec_len),
        sampling=dataclasses.replace(s.sampling, **{
            k: getattr(s.sampling, k).at[slot].set(v) for k, v in sampling_row.items()}),
        stop_flags=upd(s.stop_flags, False),
        finish_reason=upd(s.finish_reason, 0),
        paused=upd(s.paused, False),
        **extra,
    )
