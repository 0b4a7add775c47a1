"""The drafting stages of the engine step: the MTP head's stages (FastDeploy's ``MTPProposer``:
``draft_model_preprocess``, the ``_propose`` substep loop, ``draft_model_update``) and
``draft_model_postprocess``. Each stage is a pure, jittable function of typed pytrees;
:func:`jmtp.runtime.device.step.engine_step` calls :func:`jmtp.runtime.device.proposers.propose` (the registry
of proposers: MTP, n-gram, hybrid, custom) then :func:`draft_model_postprocess`.

=============================== ================================================================
stage                           FastDeploy op(s)
=============================== ================================================================
:func:`draft_model_preprocess`  ``draft_model_preprocess`` + ``eagle_get_hidden_states``: MTP
                                substep 0 inputs from the accepted tokens and target rows
:func:`mtp_substep`             one MTP forward + draft pick (``MTPSampler``), then
                                ``draft_model_update`` + ``eagle_get_self_hidden_states`` for the
                                next substep; ``proposers.propose_mtp`` applies it M times
:func:`draft_model_postprocess` ``draft_model_postprocess``: drafts into ``draft_tokens[:, 1:]``,
                                the next ``seq_lens_this_time``
=============================== ================================================================

The MTP keeps no state besides its cache (the "shadow state": its ``seq_lens_decoder`` is the
target's minus ``accept_num``; see :mod:`jmtp.runtime.device.step`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jmtp.model.config import ModelConfig
from jmtp.model.invariant import row_tiled
from jmtp.model.llama import KVCache
from jmtp.model.metadata import AttentionMetadata, packed_row_seq, ragged_batch
from jmtp.model.modules import LlamaForCausalLM
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.buckets import StepBucket
from jmtp.runtime.device.sampling import SamplingArrays, draft_sample
from jmtp.runtime.device.sampling.processors import logit_bias
from jmtp.runtime.device.sharding import uniform_any
from jmtp.runtime.device.state import EngineState, effective_block_tables
from jmtp.runtime.device.target_stages import (TargetOutput, gather_slots, pytree_dataclass,
                                               take_rows, window_rows_hint)


@pytree_dataclass
class DraftContext:
    """Per-step constants of the MTP proposal over the A compacted slots (from
    :func:`draft_model_preprocess`).

    Attributes:
      slots: i32[A]             compacted slot ids (padding = B).
      budget: i32[A]            drafts allowed per row (0 for padding rows).
      start_pos: i32[A]         MTP position of draft d1 (the target's new ``seq_lens_decoder``).
      block_tables: i32[A, P]   the rows' block tables.
      sampling: SamplingArrays  the rows' sampling parameters.
      step_idx: i32[A]          the rows' ``step_idx`` after the update.
    """

    slots: jax.Array
    budget: jax.Array
    start_pos: jax.Array
    block_tables: jax.Array
    sampling: SamplingArrays
    step_idx: jax.Array


@pytree_dataclass
class MtpBatch:
    """Inputs of one :func:`mtp_substep`: a packed ragged batch of R rows (R = T for substep 0,
    A for the later ones).

    Attributes:
      ids: i32[R]                tokens fed to the MTP.
      hidden: f[R, H]            hidden rows paired with them (the target's for substep 0, the
                                 MTP's own after).
      positions: i32[R]          MTP cache positions.
      meta: AttentionMetadata    the batch's attention metadata.
      pick_rows: i32[A]          row whose output drafts for each compacted slot.
      active: bool[A]            slot drafts at this substep.
    """

    ids: jax.Array
    hidden: jax.Array
    positions: jax.Array
    meta: AttentionMetadata
    pick_rows: jax.Array
    active: jax.Array


@pytree_dataclass
class DraftPick:
    """Output of one :func:`mtp_substep` for the A compacted slots.

    Attributes:
      tokens: i32[A]          the draft, -1 where the slot is not active.
      probs: f32[A, V] | None its exact distribution q (``draft_sampling`` only).
    """

    tokens: jax.Array
    probs: jax.Array | None


def draft_model_preprocess(mc: ModelConfig, ec: EngineConfig, num_tokens: int, state: EngineState,
                           prev_seq_lens_decoder: jax.Array, target: TargetOutput,
                           draft_budget: jax.Array) -> tuple[DraftContext, MtpBatch]:
    """Inputs of MTP substep 0 (FastDeploy ``draft_model_preprocess`` +
    ``eagle_get_hidden_states``).

    Substep 0 processes MTP positions ``p in [dec_old, dec_old + q)`` with tokens
    ``input_ids[p + 1]`` (prompt tokens, then the tokens just committed) paired with the target's
    hidden row of position p; ``q`` is the prefill chunk or the committed count (0 for finished,
    paused and idle slots). Each compacted slot drafts from its last row.

    Args:
      num_tokens: static T (rows of the packed batch, as the target's).
      state: the state after :func:`~jmtp.runtime.device.target_stages.speculate_update`.
      prev_seq_lens_decoder: i32[B] ``seq_lens_decoder`` before the update (``dec_old``).
      target: this step's :class:`~jmtp.runtime.device.target_stages.TargetOutput` (hidden rows, row
        offsets, compacted slots).
      draft_budget: i32[B] drafts allowed per slot.

    Returns:
      ``(DraftContext, MtpBatch)`` for :func:`mtp_substep`.
    """
    B, bs = ec.max_num_seqs, ec.block_size
    target_hidden, cu_t, slots, valid = target.hidden, target.cu_q_lens, target.slots, target.valid
    decoded = prev_seq_lens_decoder
    tables = effective_block_tables(state)        # shared prefix pages, then owned blocks
    slot_rows = jnp.minimum(slots, B - 1)
    ctx = DraftContext(
        slots=slots, budget=jnp.where(valid, draft_budget[slot_rows], 0),
        start_pos=state.seq_lens_decoder[slot_rows], block_tables=tables[slot_rows],
        sampling=gather_slots(state.sampling, slot_rows), step_idx=state.step_idx[slot_rows])
    query_lens = jnp.where(state.stop_flags, 0, jnp.where(state.seq_lens_encoder > 0,
                                                          state.seq_lens_encoder, state.accept_num))
    positions, meta = ragged_batch(query_lens, decoded, tables, bs, num_tokens,
                                   window_rows_hint(ec, StepBucket(num_tokens, slots.shape[0])))
    cu_q_lens = meta.cu_q_lens
    seq, local = packed_row_seq(cu_q_lens, num_tokens)
    ids = state.input_ids[seq, jnp.clip(positions + 1, 0, ec.seq_buffer_len - 1)]
    ids = jnp.clip(ids, 0, mc.vocab_size - 1)
    h_in = take_rows(target_hidden, cu_t[seq] + local)
    last = cu_q_lens[slot_rows] + query_lens[slot_rows] - 1                  # i32[A]
    return ctx, MtpBatch(ids=ids, hidden=h_in, positions=positions, meta=meta, pick_rows=last,
                         active=ctx.budget > 0)


def _pick(ec: EngineConfig, model: LlamaForCausalLM, ctx: DraftContext, h_rows, sub: int):
    """Draft ``sub`` (0-based) from MTP hidden rows ``h_rows f[A, H]``: argmax, or a sample with
    its exact distribution q; over the FR-Spec draft vocabulary when the model has a
    :class:`~jmtp.model.modules.DraftHead` (a static, structural choice), else the full one."""
    draft_head = model.draft_head
    if draft_head is None:
        logits = model.logits(h_rows)
    elif model.cfg.batch_invariant:     # fixed row tiles (jmtp.model.invariant)
        logits = row_tiled(draft_head, h_rows)
    else:
        logits = draft_head(h_rows)
    # the request's logit_bias: drafts follow the distribution the target verifies against
    logits = logit_bias(logits, ctx.sampling, None if draft_head is None
                        else draft_head.token_ids[...])
    tokens, probs = draft_sample(
        logits, ctx.sampling, ctx.step_idx + sub,
        draft_sampling=ec.spec.draft_sampling, draft_temperature=ec.spec.draft_temperature,
        draft_top_p=ec.spec.draft_top_p, draft_top_k=ec.spec.draft_top_k)
    if draft_head is not None:    # back to full-vocabulary ids (q is zero off the N tokens)
        tokens, probs = draft_head.to_vocab(tokens, probs, model.cfg.vocab_size)
    return tokens.astype(jnp.int32), (None if probs is None else probs.astype(jnp.float32))


def mtp_substep(ec: EngineConfig, attention_impl: str | None, sub: int,
                model: LlamaForCausalLM, ctx: DraftContext, batch: MtpBatch, mtp_cache: KVCache
                ) -> tuple[DraftPick, MtpBatch, KVCache]:
    """One MTP propose substep ``sub`` (static, 0-based): the MTP layer ``sub % num_mtp_layers``
    over ``batch``, a draft per active slot from its pick row (skipped at run time with
    ``lax.cond`` when no slot is active: saves the draft LM head, and for ``sub >= 1`` the MTP
    layer too, e.g. when the dynamic policy allows every slot at most ``sub`` drafts), then the
    inputs of substep
    ``sub + 1`` (FastDeploy ``draft_model_update`` + ``eagle_get_self_hidden_states``): the
    slots whose budget exceeds ``sub + 1`` feed their draft and the MTP's own hidden row at
    position ``start_pos + sub``, one row each in compacted-slot order.

    Returns:
      ``(DraftPick, MtpBatch of substep sub + 1 (A rows), updated MTP cache)``.
    """
    A = ctx.slots.shape[0]
    vocab_size = model.cfg.vocab_size
    num_layers = max(model.cfg.num_mtp_layers, 1)
    # h_norm: post-final-norm rows (drafts are picked from them); h_out: the hidden input of the
    # next substep (eagle_get_self_hidden_states; pre- or post-norm by ModelConfig.mtp_layout).
    def forward(cache):
        return model.mtp_forward(sub % num_layers, batch.ids, batch.hidden, batch.positions,
                                 batch.meta, cache, attention_impl)

    def no_forward(cache):     # no slot drafts this substep: it would write no cache row
        h_norm, h_out, _ = jax.eval_shape(forward, cache)
        return jnp.zeros(h_norm.shape, h_norm.dtype), jnp.zeros(h_out.shape, h_out.dtype), cache

    if sub == 0:   # substep 0 also fills the MTP cache for the committed tokens: always runs
        h_norm, h_out, mtp_cache = forward(mtp_cache)
    else:
        h_norm, h_out, mtp_cache = jax.lax.cond(uniform_any(batch.active), forward, no_forward,
                                                mtp_cache)

    def run(h_rows):
        return _pick(ec, model, ctx, h_rows, sub)

    def skip(h_rows):
        tokens = jnp.zeros((h_rows.shape[0],), jnp.int32)
        if not ec.spec.draft_sampling:
            return tokens, None
        return tokens, jnp.zeros((h_rows.shape[0], vocab_size), jnp.float32)

    draft, probs = jax.lax.cond(uniform_any(batch.active), run, skip,
                                take_rows(h_norm, batch.pick_rows))
    h_prev = take_rows(h_out, batch.pick_rows)
    pick = DraftPick(tokens=jnp.where(batch.active, draft, -1), probs=probs)

    # Inputs of the next substep: rows packed in compacted-slot order; row i's token is at
    # cu_s[i] when active.
    active = batch.active & (ctx.budget > sub + 1)
    positions, meta = ragged_batch(active.astype(jnp.int32), ctx.start_pos + sub,
                                   ctx.block_tables, ec.block_size, A)
    rows = jnp.clip(meta.cu_q_lens[:A], 0, A - 1)
    scatter = jnp.where(active, rows, A)
    ids = jnp.zeros((A,), jnp.int32).at[scatter].set(jnp.clip(draft, 0, vocab_size - 1),
                                                       mode="drop")
    hidden = jnp.zeros_like(h_prev).at[scatter].set(h_prev, mode="drop")
    return pick, MtpBatch(ids=ids, hidden=hidden, positions=positions, meta=meta, pick_rows=rows,
                          active=active), mtp_cache


def draft_model_postprocess(ec: EngineConfig, state: EngineState, prev_state: EngineState,
                            drafts: jax.Array, draft_probs: jax.Array | None,
                            draft_budget: jax.Array) -> EngineState:
    """Write the next verify windows (FastDeploy ``draft_model_postprocess``).

    Drafts past a slot's budget are dropped, then everything after the first missing draft (a
    window's drafts are a prefix), and ``draft_tokens[:, 1:]`` / ``draft_probs`` take them; the
    next ``seq_lens_this_time`` of a decoding slot is ``1 + #drafts``
    (:func:`~jmtp.runtime.device.target_stages.schedule`), and ``actual_draft_token_num`` the budget (a
    window may hold fewer drafts: an n-gram proposer without a match). A paused slot did nothing
    this step: it keeps ``prev_state``'s window and budget for the retry.

    Args:
      state: the state after :func:`~jmtp.runtime.device.target_stages.speculate_update` (window
        ``[last, -1, ...]``).
      prev_state: the state the step started from.
      drafts: i32[B, K] proposed drafts (-1 = none).
      draft_probs: f32[B, K, V] their distributions q, or None (greedy one-hot drafts; zeros are
        stored when ``draft_sampling`` is on).
      draft_budget: i32[B] drafts allowed per slot.
    """
    K = ec.k
    paused = state.paused
    drafts = jnp.where(jnp.arange(K)[None] < draft_budget[:, None], drafts, -1)
    # Drafts are a prefix: stop at the first missing one.
    present = jnp.cumprod((drafts >= 0).astype(jnp.int32), axis=1) > 0
    drafts = jnp.where(present, drafts, -1)
    new_window = state.draft_tokens.at[:, 1:].set(drafts)
    state = dataclasses.replace(
        state, draft_tokens=jnp.where(paused[:, None], prev_state.draft_tokens, new_window),
        actual_draft_token_num=jnp.where(paused, prev_state.actual_draft_token_num,
                                         draft_budget).astype(jnp.int32))
    if ec.spec.draft_sampling:
        q = draft_probs if draft_probs is not None else jnp.zeros_like(prev_state.draft_probs)
        state = dataclasses.replace(
            state, draft_probs=jnp.where(paused[:, None, None], prev_state.draft_probs, q))
    return state
