"""The engine step: one jitted pure function wired over named, pure stages (the speculative
branch of FastDeploy's target model runner ``execute_model``, with the "shadow state" MTP that
later FastDeploy versions adopted: the MTP's decode state is derived from the target's and
``accept_num``, never rolled back). :func:`engine_step` is the whole step, compiled once per step
bucket with the state and both caches donated; each stage is a function of typed pytrees in →
typed pytrees out, jittable and tested on its own (``tests/runtime/test_stages.py``).

=========================== ====================================================================
stage (this module)         FastDeploy op(s)
=========================== ====================================================================
:func:`schedule`            the ``seq_lens_this_time`` the scheduler / ``draft_model_postprocess``
                            set: per slot the prefill chunk (``seq_lens_encoder``) or the verify
                            window ``1 + #drafts`` (the runner copies it into the next
                            step's buffer; request insertion sets a new request's)
:func:`allocate_blocks`     ``speculate_step_paddle`` / ``step_cuda`` block top-up (and the MTP's
                            ``mtp_step_paddle``, whose cache shares the block ids here):
                            every scheduled slot gets the blocks its writes need, all or nothing,
                            else it is paused (``is_block_step``)
:func:`target_forward`      ``speculate_get_padding_offset`` + model forward + ``rebuild_padding``
                            + ``compute_logits``: window rows only
:func:`speculate_verify`    ``top_p_candidates`` + ``speculate_verify`` (``SpeculativeSampler``)
:func:`speculate_update`    ``speculate_update`` + ``speculate_set_value_by_flags_and_idx``
                            (``post_process_specualate``): stop checks, truncation at the first
                            stop, token append
:func:`draft_model_preprocess`  ``draft_model_preprocess`` + ``eagle_get_hidden_states``: MTP
                            substep 0 inputs from the accepted tokens and target rows
:func:`mtp_substep`         one MTP forward + draft pick, then ``draft_model_update`` +
                            ``eagle_get_self_hidden_states`` (the proposer's ``_propose`` loop
                            and ``MTPSampler``) for the next substep; the step applies it M times
:func:`draft_model_postprocess`  ``draft_model_postprocess``: drafts into
                            ``draft_tokens[:, 1:]``, the next ``seq_lens_this_time``
:func:`release_finished`    the release half of ``speculate_step_paddle``: finished slots
                            return their blocks in the step they finish
=========================== ====================================================================

The step calls the allocator twice: the top-up at the start (a slot's need depends on this step's
schedule) and the release at the end (a slot's blocks return in the step it finishes, so the host
sees them free at once and an idle engine owns no blocks). Folding the release into the next
step's single call would hold a finished request's blocks for one more step.

With prefix caching (``EngineConfig.enable_prefix_caching``, :mod:`jmtp.runtime.prefix_cache`)
a slot may start with read-only cached blocks in front of its owned ones: the stages read every
block table through :func:`~jmtp.runtime.state.effective_block_tables`, the top-up counts only
the owned pages, and the final release is left to the host (:func:`retire_slot` keeps the full
blocks it caches; :func:`push_free_blocks` returns evicted ones), the one-graph step otherwise
unchanged.

Every stage output is a frozen dataclass registered with ``jax.tree_util.register_dataclass``;
all fields are data (array leaves, or None for an absent optional array), static sizes live in
:class:`~jmtp.runtime.config.EngineConfig` / :class:`~jmtp.runtime.buckets.StepBucket`.

The MTP keeps no state besides its cache: it processes positions ``[dec_old, dec_old + a)`` of the
one-position-shifted cache (position p holds (x_{p+1}, h_p)), i.e. its ``seq_lens_decoder`` is the
target's minus ``accept_num`` (the "shadow state": FastDeploy's own recovery formula subtracted
``seq_lens_this_time``, right only when every draft was accepted). Speculative positions written
by substeps ≥ 1 lie past the next step's kv length and are overwritten before they are ever read.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jmtp.model.config import ModelConfig
from jmtp.model.llama import KVCache
from jmtp.model.metadata import AttentionMetadata, packed_row_seq, ragged_batch
from jmtp.model.modules import LlamaForCausalLM
from jmtp.runtime.buckets import StepBucket, active_slots
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.sharding import uniform_any
from jmtp.runtime.ngram import extend_with_ngram, ngram_match
from jmtp.runtime.sampling import SamplingArrays, draft_sample, update_history
from jmtp.runtime.state import (FINISH_LENGTH, FINISH_NONE, FINISH_STOP, EngineState,
                                effective_block_tables)
from jmtp.runtime.verify import verify

from jmtp.pallas.block_allocator import BlockAllocatorState, blocks_needed


def _pytree(cls):
    """Frozen dataclass registered as a pytree whose fields are all data (no static fields)."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    """What the host reads back after each step (small arrays only; every field is data).

    Attributes:
      tokens: i32[B, K+1]      emitted tokens, -1 past ``num_tokens``.
      num_tokens: i32[B]       tokens committed this step (0 for idle / mid-prefill / paused slots).
      num_drafts: i32[B]       drafts verified this step.
      num_allowed: i32[B]      drafts the verified window was allowed when it was proposed
                               (``EngineState.actual_draft_token_num``; 0 unless the slot verified
                               a window this step): ``>= num_drafts``, more where an n-gram or
                               hybrid proposer found fewer tokens than its budget.
      num_accepted: i32[B]     drafts accepted and committed this step.
      finished: bool[B]        slot finished this step.
      finish_reason: i32[B]    FINISH_STOP / FINISH_LENGTH for finished slots.
      paused: bool[B]          slot could not get KV blocks (did nothing this step).
      free_count: i32[]        free KV blocks after the step.
      num_next_drafts: i32[B]  drafts in the slot's next verify window (the next step verifies
                               ``1 + num_next_drafts`` rows for a decoding slot).
      logprobs: f32[B, K+1]    logprob of each emitted token (None unless max_logprobs > 0).
      top_logprob_ids: i32[B, K+1, n] / top_logprobs: f32[B, K+1, n]  the target's top-n.
    """

    tokens: jax.Array
    num_tokens: jax.Array
    num_drafts: jax.Array
    num_accepted: jax.Array
    finished: jax.Array
    finish_reason: jax.Array
    paused: jax.Array
    free_count: jax.Array
    num_next_drafts: jax.Array | None = None
    num_allowed: jax.Array | None = None
    logprobs: jax.Array | None = None
    top_logprob_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


@_pytree
class Schedule:
    """What each slot does this step (output of :func:`schedule`, refined by
    :func:`allocate_blocks`).

    Attributes:
      seq_lens_this_time: i32[B]  query rows: the prefill chunk, ``1 + num_drafts`` for a verify
                                  window, 0 for idle / finished / paused slots.
      seq_lens_encoder: i32[B]    prefill chunk (0 unless prefilling).
      num_drafts: i32[B]          drafts verified (0 unless decoding).
      prefilling: bool[B]         slot runs a prefill chunk.
      decoding: bool[B]           slot runs a verify window.
      paused: bool[B]             slot was scheduled but got no KV blocks (``is_block_step``).
    """

    seq_lens_this_time: jax.Array
    seq_lens_encoder: jax.Array
    num_drafts: jax.Array
    prefilling: jax.Array
    decoding: jax.Array
    paused: jax.Array


@_pytree
class TargetOutput:
    """Output of :func:`target_forward`.

    Attributes:
      hidden: f[T, H]              target hidden state of every packed row, as the MTP head
                                   takes it (post-final-norm; pre-norm for MiMo,
                                   ``ModelConfig.mtp_takes_prenorm_hidden``).
      cu_q_lens: i32[B+1]          packed-row offsets of the slots.
      logit_rows: f32[R, V]        target logits of R rows: every packed row (R = T) when
                                   ``T < A·(K+1)``, else the window rows (R = A·(K+1)).
      window_rows: i32[A, K+1]     row of ``logit_rows`` holding each window position of the A
                                   compacted slots (a prefill chunk's last row in column 0).
                                   Columns past a slot's window are unused.
      slots: i32[A]                compacted slot ids, ascending, padding = B
                                   (:func:`~jmtp.runtime.buckets.active_slots`).
      valid: bool[A]               row holds a slot.
    """

    hidden: jax.Array
    cu_q_lens: jax.Array
    logit_rows: jax.Array
    window_rows: jax.Array
    slots: jax.Array
    valid: jax.Array

    def window_logits(self, width: int) -> jax.Array:
        """``f32[A, width, V]``: the first ``width`` window positions' logits."""
        A = self.window_rows.shape[0]
        rows = self.window_rows[:, :width].reshape(-1)
        return _take_rows(self.logit_rows, rows).reshape(A, width, -1)


@_pytree
class Verified:
    """Output of :func:`speculate_verify` (per slot, before stop truncation).

    Attributes:
      accept_tokens: i32[B, K+1]   accepted drafts then the correction / bonus token (>= 0; the
                                   entries at and past ``accept_num`` are meaningless). A resumed
                                   request's first token is its ``resume_token``.
      accept_num: i32[B]           tokens to emit: ``1 + accepted drafts`` for a decoding slot, 1
                                   for the step that finishes a prefill, else 0.
      num_accepted: i32[B]         drafts accepted (meaningful for decoding slots only).
      logprobs, top_logprob_ids, top_logprobs: as :class:`StepOutput` (None without logprobs).
    """

    accept_tokens: jax.Array
    accept_num: jax.Array
    num_accepted: jax.Array
    logprobs: jax.Array | None = None
    top_logprob_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


@_pytree
class Committed:
    """Output of :func:`speculate_update` besides the new state.

    Attributes:
      tokens: i32[B, K+1]    committed tokens, -1 past ``num_tokens``.
      num_tokens: i32[B]     committed this step (``accept_num`` cut at the first stop).
      num_accepted: i32[B]   drafts among them (0 unless decoding).
      finished: bool[B]      slot finished this step.
      finish_reason: i32[B]  FINISH_STOP / FINISH_LENGTH where finished, else FINISH_NONE.
      draft_budget: i32[B]   drafts the next window may hold: ``[0, K]``, never past max_tokens or
                             max_model_len (later FastDeploy skips drafting that close to the
                             limit; the pinned version drafts ``eos``); 0 for slots that cannot
                             draft.
    """

    tokens: jax.Array
    num_tokens: jax.Array
    num_accepted: jax.Array
    finished: jax.Array
    finish_reason: jax.Array
    draft_budget: jax.Array


@_pytree
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


@_pytree
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


@_pytree
class DraftPick:
    """Output of one :func:`mtp_substep` for the A compacted slots.

    Attributes:
      tokens: i32[A]          the draft, -1 where the slot is not active.
      probs: f32[A, V] | None its exact distribution q (``draft_sampling`` only).
    """

    tokens: jax.Array
    probs: jax.Array | None


def _take_rows(x, rows):
    return jnp.take(x, jnp.clip(rows, 0, x.shape[0] - 1), axis=0)


def _gather_slots(tree, sl):
    """Rows ``sl`` (i32[A], in range) of every ``[B, ...]`` leaf of ``tree``."""
    return jax.tree_util.tree_map(lambda x: x[sl], tree)


def _scatter_slots(x, slots, num_seqs, fill=0):
    """``[B, ...]`` array of ``fill`` holding row ``i`` of ``x [A, ...]`` at slot ``slots[i]``;
    padding rows (``slots[i] == B``) are dropped."""
    return jnp.full((num_seqs,) + x.shape[1:], fill, x.dtype).at[slots].set(x, mode="drop")


# ------------------------------------------------------------------------------------ stages
def schedule(ec: EngineConfig, state: EngineState, prefill_chunk: jax.Array) -> Schedule:
    """Per slot: prefill chunk, verify window or nothing (the ``seq_lens_this_time`` FastDeploy's
    scheduler and ``draft_model_postprocess`` leave for the next step).

    Args:
      ec: static engine config.
      state: the engine state.
      prefill_chunk: i32[B] prompt tokens each prefilling slot may process (clipped to what is
        left of its prompt; ignored for decoding and idle slots).

    Returns:
      :class:`Schedule` (``paused`` all False: see :func:`allocate_blocks`).
    """
    running = ~state.stop_flags
    decoded = state.seq_lens_decoder
    prefilling = running & (decoded < state.prompt_lens)
    decoding = running & ~prefilling
    chunk = jnp.where(prefilling, jnp.minimum(prefill_chunk, state.prompt_lens - decoded), 0)
    num_drafts = jnp.where(decoding, jnp.sum(state.draft_tokens[:, 1:] >= 0, axis=1), 0)
    query_lens = jnp.where(prefilling, chunk, jnp.where(decoding, 1 + num_drafts, 0))
    query_lens = query_lens.astype(jnp.int32)
    return Schedule(seq_lens_this_time=query_lens, seq_lens_encoder=chunk.astype(jnp.int32),
                    num_drafts=num_drafts.astype(jnp.int32), prefilling=prefilling,
                    decoding=decoding, paused=jnp.zeros_like(prefilling))


def allocate_blocks(ec: EngineConfig, blocks: BlockAllocatorState, sched: Schedule,
                    seq_lens_decoder: jax.Array, num_shared: jax.Array | None = None
                    ) -> tuple[BlockAllocatorState, Schedule]:
    """Top every scheduled slot up to the blocks this step's writes need, all or nothing.

    With ``d = seq_lens_decoder`` and ``n = seq_lens_this_time``, a slot writes target positions
    ``[d, d + n)`` and, with the MTP head, MTP positions up to ``d + n + M - 2``; it needs
    ``blocks_needed(d + n + max(M - 1, 0))`` blocks. A slot
    that cannot get them is paused: its row of the returned schedule is zeroed (it does nothing
    this step) and ``paused`` is set. Block ownership is the allocator's contract
    (:func:`jmtp.pallas.block_allocator.allocate_blocks`, the implementation
    ``ec.block_allocator``).

    Args:
      blocks: allocator state.
      sched: this step's :class:`Schedule`.
      seq_lens_decoder: i32[B] tokens already in the cache.
      num_shared: i32[B] read-only prefix pages of each slot (prefix caching; None = 0): they
        come before the owned blocks and are not counted in the top-up.

    Returns:
      ``(new allocator state, schedule with paused slots removed)``.
    """
    B = sched.seq_lens_this_time.shape[0]
    query_lens = sched.seq_lens_this_time
    overhang = max(ec.m - 1, 0)
    need = jnp.where(query_lens > 0,
                     blocks_needed(seq_lens_decoder + query_lens + overhang, ec.block_size), 0)
    if num_shared is not None:
        need = jnp.where(query_lens > 0, jnp.maximum(need - num_shared, 0), 0)
    blocks, paused = blocks.allocate(jnp.zeros((B,), bool), need.astype(jnp.int32),
                                     implementation=ec.block_allocator)
    paused = paused & (query_lens > 0)
    return blocks, Schedule(
        seq_lens_this_time=jnp.where(paused, 0, query_lens),
        seq_lens_encoder=jnp.where(paused, 0, sched.seq_lens_encoder),
        num_drafts=jnp.where(paused, 0, sched.num_drafts),
        prefilling=sched.prefilling & ~paused, decoding=sched.decoding & ~paused, paused=paused)


def window_rows_hint(ec: EngineConfig, bucket: StepBucket) -> int | None:
    """The attention schedule hint (``AttentionMetadata.rows_per_seq``) of a step in ``bucket``:
    K+1 when its rows are mostly verify windows of several rows (``A < T <= A·(K+1)``), so
    attention gathers each sequence's pages once per window instead of once per row; None (the
    row-tile schedule) otherwise: one row per slot, or the larger prefill buckets. (A small
    prefill bucket with ``A = B`` shares its key with a decode bucket and gets the hint too: a
    prefill chunk there is visited K+1 rows at a time, right but with more page gathers.)"""
    T, A = bucket.num_tokens, bucket.num_slots
    return ec.window if A < T <= A * ec.window else None


def target_forward(ec: EngineConfig, bucket: StepBucket, attention_impl: str | None,
                   model: LlamaForCausalLM, state: EngineState, sched: Schedule,
                   block_tables: jax.Array, cache: KVCache) -> tuple[TargetOutput, KVCache]:
    """Target forward over the packed ragged batch, then the logits of the window rows only
    (``min(T, A·(K+1))`` LM-head rows: a step of slots that drafted nothing costs the LM head of
    a plain step).

    Row ``t`` of the packed batch is query ``local`` of slot ``seq``: a prompt token
    (``input_ids[seq, seq_lens_decoder[seq] + local]``) for a prefill chunk and for position 0 of a verify window
    (the last accepted token, already in ``input_ids``), else draft ``draft_tokens[seq, local]``.

    Args:
      bucket: static (T, A) sizes; requires ``sum(seq_lens_this_time) <= T`` and at most A slots
        with work.
      model: the target (its ``__call__`` and ``logits``).
      block_tables: i32[B, P] after :func:`allocate_blocks`.

    Returns:
      ``(TargetOutput, updated target cache)``.
    """
    B, W = ec.max_num_seqs, ec.window
    num_tokens, A = bucket.num_tokens, bucket.num_slots
    query_lens, prefill_lens = sched.seq_lens_this_time, sched.seq_lens_encoder
    decoded = state.seq_lens_decoder
    positions, meta = ragged_batch(query_lens, decoded, block_tables, ec.block_size, num_tokens,
                                   window_rows_hint(ec, bucket))
    cu_q_lens = meta.cu_q_lens
    seq, local = packed_row_seq(cu_q_lens, num_tokens)
    from_prompt = sched.prefilling[seq] | (local == 0)
    ids = jnp.where(from_prompt,
                    state.input_ids[seq, jnp.clip(decoded[seq] + local, 0, ec.seq_buffer_len - 1)],
                    state.draft_tokens[seq, jnp.clip(local, 0, W - 1)])
    ids = jnp.clip(ids, 0, model.cfg.vocab_size - 1)
    hidden, cache = model(ids, positions, meta, cache, attention_impl)

    # Compact the slots with work into A rows (slot ids ascending, then padding = B); logits and
    # verification run over those rows only and are scattered back to [B, ...].
    slots, valid = active_slots(query_lens > 0, A)
    slot_rows = jnp.minimum(slots, B - 1)                                # in-range gather index

    # Window rows: all 1+n rows of a verify window; the last row of a prefill chunk.
    w = jnp.arange(W, dtype=jnp.int32)
    start = cu_q_lens[slot_rows, None]
    rows = jnp.where(sched.prefilling[slot_rows, None], start + prefill_lens[slot_rows, None] - 1,
                     start + w[None])                                    # i32[A, W]
    if num_tokens < A * W:
        # Fewer packed rows than window rows (decode steps whose slots drafted little or
        # nothing): the LM head runs over the T packed rows; the windows index into them.
        logit_rows, window_rows = model.target_logits(hidden), jnp.clip(rows, 0, num_tokens - 1)
    else:
        logit_rows = model.target_logits(_take_rows(hidden, rows.reshape(-1)))
        window_rows = jnp.arange(A * W, dtype=jnp.int32).reshape(A, W)
    return TargetOutput(hidden=hidden, cu_q_lens=cu_q_lens, logit_rows=logit_rows,
                        window_rows=window_rows, slots=slots, valid=valid), cache


def speculate_verify(mc: ModelConfig, ec: EngineConfig, state: EngineState, sched: Schedule,
                     target: TargetOutput) -> Verified:
    """Verify each decoding slot's drafts against the target's window logits (penalties,
    min_tokens and bad words applied at every row; strategy ``ec.spec.verify_strategy``, see
    :func:`jmtp.runtime.verify.verify`), and take the first token of a slot whose prefill ends.

    Returns:
      :class:`Verified` over the B slots (no stop truncation: :func:`speculate_update` does it).
    """
    B = ec.max_num_seqs
    prev = state   # the state the step started from
    slots, valid = target.slots, target.valid
    slot_rows = jnp.minimum(slots, B - 1)
    sampling = _gather_slots(prev.sampling, slot_rows)
    # Padding rows (results dropped) are greedy with no penalty or filter, so the run-time
    # shortcuts of verify (all-greedy batch, no penalty, no filter) hold whatever the slot their
    # rows were gathered from holds (finished requests leave their parameters behind).
    neutral = dict(temperature=0.0, repetition_penalty=1.0, frequency_penalty=0.0,
                   presence_penalty=0.0, top_k=0, top_p=1.0, min_p=0.0)
    sampling = dataclasses.replace(sampling, **{
        k: jnp.where(valid, getattr(sampling, k), jnp.asarray(v, getattr(sampling, k).dtype))
        for k, v in neutral.items()})
    num_drafts = jnp.where(valid, sched.num_drafts[slot_rows], 0)
    W = ec.window

    def verify_width(width: int):
        """verify over the first ``width`` window positions, padded back to K+1 columns."""
        probs = None if prev.draft_probs is None else prev.draft_probs[slot_rows, :width - 1]
        res = verify(target.window_logits(width), prev.draft_tokens[slot_rows, 1:width],
                     jnp.minimum(num_drafts, width - 1), probs, sampling,
                     prev.step_idx[slot_rows], jnp.asarray(mc.eos_token_ids or (-1,), jnp.int32),
                     strategy=ec.spec.verify_strategy,
                     max_candidate_len=ec.spec.max_candidate_len,
                     verify_window=ec.spec.verify_window, num_logprobs=ec.max_logprobs,
                     truncate_at_stop=False)
        pad = lambda x, fill: None if x is None else jnp.pad(  # noqa: E731
            x, [(0, 0), (0, W - width)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return dataclasses.replace(
            res, accept_tokens=pad(res.accept_tokens, -1), logprobs=pad(res.logprobs, 0.0),
            top_logprob_ids=pad(res.top_logprob_ids, 0), top_logprobs=pad(res.top_logprobs, 0.0))

    if W == 1:
        result = verify_width(1)
    else:   # no window holds a draft (e.g. the dynamic policy chose 0): verify one row per slot
        result = jax.lax.cond(uniform_any(num_drafts > 0), lambda: verify_width(W),
                              lambda: verify_width(1))
    result = jax.tree_util.tree_map(lambda x: _scatter_slots(x, slots, B), result)
    target_tok = jnp.maximum(result.accept_tokens, 0)
    num_accepted = result.accept_num - 1
    finishing_prefill = sched.prefilling & (
        prev.seq_lens_decoder + sched.seq_lens_encoder == prev.prompt_lens)
    # A request resumed after a preemption re-emits its last token (insert_request's resume_token).
    resume = finishing_prefill & (prev.draft_tokens[:, 0] >= 0)
    target_tok = target_tok.at[:, 0].set(jnp.where(resume, prev.draft_tokens[:, 0],
                                                   target_tok[:, 0]))
    accept_num = jnp.where(finishing_prefill, 1, jnp.where(sched.decoding, num_accepted + 1, 0))
    return Verified(accept_tokens=target_tok, accept_num=accept_num.astype(jnp.int32),
                    num_accepted=num_accepted.astype(jnp.int32), logprobs=result.logprobs,
                    top_logprob_ids=result.top_logprob_ids, top_logprobs=result.top_logprobs)


def truncate_at_stop(tokens: jax.Array, num: jax.Array, step_idx: jax.Array,
                     seq_len: jax.Array, stop_token_ids: jax.Array, min_tokens: jax.Array,
                     max_dec_len: jax.Array, max_model_len: int
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stop and length truncation of B candidate rows (the one place they are decided).

    Token ``w < num[b]`` of ``tokens i32[B, W]`` is the ``step_idx[b] + w + 1``-th generated token
    and sits at sequence position ``seq_len[b] + w``. It stops the slot if it is one of
    ``stop_token_ids[b]`` (entries >= 0) and at least ``min_tokens[b]`` tokens are then generated
    (FINISH_STOP), or if it reaches ``max_dec_len[b]`` generated tokens or ``max_model_len``
    sequence tokens (FINISH_LENGTH). The row is cut after its first stopping token.

    Returns:
      ``(num i32[B] cut at the first stop, finished bool[B], reason i32[B])``; ``reason`` is
      FINISH_STOP where the first stop is a stop token, else FINISH_LENGTH (meaningless where not
      finished).
    """
    W = tokens.shape[1]
    w = jnp.arange(W, dtype=jnp.int32)
    valid = w[None] < num[:, None]
    stop_ids = stop_token_ids
    is_stop_tok = jnp.any((tokens[:, :, None] == stop_ids[:, None, :])
                          & (stop_ids[:, None, :] >= 0), axis=-1)
    is_stop_tok &= (step_idx[:, None] + w[None] + 1) > min_tokens[:, None]
    is_len = ((step_idx[:, None] + w[None] + 1) >= max_dec_len[:, None]) | (
        (seq_len[:, None] + w[None] + 1) >= max_model_len)
    stop_at = valid & (is_stop_tok | is_len)
    any_stop = jnp.any(stop_at, axis=1)
    first = jnp.argmax(stop_at, axis=1)
    num = jnp.where(any_stop, first + 1, num).astype(jnp.int32)
    reason = jnp.where(jnp.take_along_axis(is_stop_tok, first[:, None], 1)[:, 0],
                       FINISH_STOP, FINISH_LENGTH)
    return num, any_stop, reason.astype(jnp.int32)


def speculate_update(ec: EngineConfig, state: EngineState, sched: Schedule, verified: Verified,
                     blocks: BlockAllocatorState) -> tuple[EngineState, Committed]:
    """Commit the verified tokens (FastDeploy ``speculate_update`` +
    ``speculate_set_value_by_flags_and_idx``).

    Per slot: cut ``accept_num`` at the first stop (:func:`truncate_at_stop`), append the
    committed tokens to ``input_ids`` (and the penalty histories), advance ``seq_lens_decoder``
    (by the chunk when prefilling, by the committed tokens when decoding) and ``step_idx``, set
    ``stop_flags`` / ``finish_reason`` of finished slots, and start the next window
    ``draft_tokens = [last committed token, -1, ...]`` (drafts come from the proposer).

    Returns:
      ``(new state, Committed)``; the new state also records this step's schedule
      (``seq_lens_this_time/encoder``, ``num_drafts``, ``paused``) and ``blocks``.
    """
    B, W, K = ec.max_num_seqs, ec.window, ec.k
    prev = state   # the state the step started from
    decoded = prev.seq_lens_decoder
    query_lens, prefill_lens = sched.seq_lens_this_time, sched.seq_lens_encoder
    prefilling, decoding = sched.prefilling, sched.decoding
    w = jnp.arange(W, dtype=jnp.int32)
    target_tok, verified_accepted = verified.accept_tokens, verified.num_accepted
    seq_len = prev.prompt_lens + prev.step_idx                       # tokens in the sequence
    num_committed, finished, reason = truncate_at_stop(
        target_tok, verified.accept_num, prev.step_idx, seq_len, prev.sampling.stop_token_ids,
        prev.sampling.min_tokens, prev.max_dec_len, ec.max_model_len)
    valid = w[None] < num_committed[:, None]
    tokens = jnp.where(valid, target_tok, -1)
    num_accepted = jnp.where(decoding, jnp.minimum(verified_accepted, num_committed), 0)

    write_at = jnp.where(valid, seq_len[:, None] + w[None], ec.seq_buffer_len)
    input_ids = prev.input_ids.at[jnp.arange(B)[:, None], write_at].set(tokens, mode="drop")
    step_idx = prev.step_idx + num_committed
    new_decoded = jnp.where(prefilling, decoded + prefill_lens,
                            jnp.where(decoding, decoded + num_committed, decoded))
    last_tok = jnp.take_along_axis(tokens, jnp.clip(num_committed - 1, 0, W - 1)[:, None], 1)[:, 0]
    stop_flags = prev.stop_flags | finished
    draft0 = jnp.where(num_committed > 0, last_tok, prev.draft_tokens[:, 0])

    # Drafts allowed next step: never past max_tokens or max_model_len (later FastDeploy versions
    # also skip drafting near the limit; the version jmtp follows drafts ``eos`` there instead).
    new_seq_len = prev.prompt_lens + step_idx
    allowed = jnp.clip(jnp.minimum(prev.max_dec_len - step_idx - 1,
                                   ec.max_model_len - new_seq_len - 1), 0, K)
    can_draft = ~stop_flags & (new_decoded >= prev.prompt_lens) & (num_committed > 0)
    allowed = jnp.where(can_draft, allowed, 0)

    new_state = dataclasses.replace(
        prev, input_ids=input_ids, seq_lens_encoder=prefill_lens, seq_lens_decoder=new_decoded,
        seq_lens_this_time=query_lens, step_idx=step_idx, accept_tokens=tokens,
        accept_num=num_committed,
        num_drafts=sched.num_drafts, stop_flags=stop_flags,
        sampling=update_history(prev.sampling, tokens, num_committed),
        finish_reason=jnp.where(finished, reason, prev.finish_reason),
        blocks=blocks, paused=sched.paused,
        draft_tokens=jnp.full((B, W), -1, jnp.int32).at[:, 0].set(draft0))
    return new_state, Committed(
        tokens=tokens, num_tokens=num_committed, num_accepted=num_accepted.astype(jnp.int32),
        finished=finished, finish_reason=jnp.where(finished, reason, FINISH_NONE),
        draft_budget=allowed.astype(jnp.int32))


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
      state: the state after :func:`speculate_update`.
      prev_seq_lens_decoder: i32[B] ``seq_lens_decoder`` before the update (``dec_old``).
      target: this step's :class:`TargetOutput` (hidden rows, row offsets, compacted slots).
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
        sampling=_gather_slots(state.sampling, slot_rows), step_idx=state.step_idx[slot_rows])
    query_lens = jnp.where(state.stop_flags, 0, jnp.where(state.seq_lens_encoder > 0,
                                                          state.seq_lens_encoder, state.accept_num))
    positions, meta = ragged_batch(query_lens, decoded, tables, bs, num_tokens,
                                   window_rows_hint(ec, StepBucket(num_tokens, slots.shape[0])))
    cu_q_lens = meta.cu_q_lens
    seq, local = packed_row_seq(cu_q_lens, num_tokens)
    ids = state.input_ids[seq, jnp.clip(positions + 1, 0, ec.seq_buffer_len - 1)]
    ids = jnp.clip(ids, 0, mc.vocab_size - 1)
    h_in = _take_rows(target_hidden, cu_t[seq] + local)
    last = cu_q_lens[slot_rows] + query_lens[slot_rows] - 1                  # i32[A]
    return ctx, MtpBatch(ids=ids, hidden=h_in, positions=positions, meta=meta, pick_rows=last,
                         active=ctx.budget > 0)


def _pick(ec: EngineConfig, model: LlamaForCausalLM, ctx: DraftContext, h_rows, sub: int):
    """Draft ``sub`` (0-based) from MTP hidden rows ``h_rows f[A, H]``: argmax, or a sample with
    its exact distribution q; over the FR-Spec draft vocabulary when the model has a
    :class:`~jmtp.model.modules.DraftHead` (a static, structural choice), else the full one."""
    draft_head = model.draft_head
    logits = draft_head(h_rows) if draft_head is not None else model.logits(h_rows)
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
                                _take_rows(h_norm, batch.pick_rows))
    h_prev = _take_rows(h_out, batch.pick_rows)
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
    next ``seq_lens_this_time`` of a decoding slot is ``1 + #drafts`` (:func:`schedule`), and
    ``actual_draft_token_num`` the budget (a window may hold fewer drafts: an n-gram proposer
    without a match). A paused slot did nothing this step: it keeps ``prev_state``'s window and
    budget for the retry.

    Args:
      state: the state after :func:`speculate_update` (window ``[last, -1, ...]``).
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


def release_finished(ec: EngineConfig, state: EngineState, finished: jax.Array) -> EngineState:
    """Return the KV blocks of the slots in ``finished bool[B]`` to the free stack, with the
    allocator ``ec.block_allocator``."""
    B = finished.shape[0]
    blocks, _ = state.blocks.allocate(finished, jnp.zeros((B,), jnp.int32),
                                      implementation=ec.block_allocator)
    return dataclasses.replace(state, blocks=blocks)


# ------------------------------------------------------------------------------ the step
def _propose(ec: EngineConfig, drafter, num_tokens: int, attention_impl: str | None,
             model: LlamaForCausalLM, state: EngineState, prev_seq_lens_decoder: jax.Array,
             target: TargetOutput, draft_budget: jax.Array, mtp_cache: KVCache | None):
    """Drafts ``i32[B, K]`` and their distributions q (``f32[B, K, V]`` or None) for the next
    windows: the MTP head (:func:`draft_model_preprocess`, then :func:`mtp_substep` M times, with
    the n-gram extension of ``hybrid_mtp_ngram``), the n-gram matcher, or a custom drafter."""
    B, K, M = ec.max_num_seqs, ec.k, ec.m
    drafts = jnp.full((B, K), -1, jnp.int32)
    draft_probs = None
    ngram_min, ngram_max = ec.spec.ngram_sizes
    new_seq_len = state.prompt_lens + state.step_idx
    if M > 0:
        ctx, batch = draft_model_preprocess(model.cfg, ec, num_tokens, state,
                                            prev_seq_lens_decoder, target, draft_budget)
        picks = []
        for sub in range(M):
            pick, batch, mtp_cache = mtp_substep(ec, attention_impl, sub, model, ctx, batch,
                                                 mtp_cache)
            picks.append(pick)
        A = ctx.slots.shape[0]
        drafts = jnp.stack([p.tokens for p in picks], axis=1)
        if M < K:
            drafts = jnp.concatenate([drafts, jnp.full((A, K - M), -1, jnp.int32)], axis=1)
        drafts = _scatter_slots(drafts, ctx.slots, B, fill=-1)          # back to i32[B, K]
        if ec.spec.draft_sampling:
            draft_probs = jnp.stack([p.probs for p in picks], axis=1)
            if M < K:
                draft_probs = jnp.concatenate(
                    [draft_probs, jnp.zeros((A, K - M, draft_probs.shape[-1]))], axis=1)
            draft_probs = _scatter_slots(draft_probs, ctx.slots, B)
        if ngram_max:   # hybrid_mtp_ngram: n-gram tokens extend the M MTP drafts up to K
            mtp_drafts = jnp.where(jnp.arange(K)[None] < draft_budget[:, None], drafts, -1)
            drafts = jax.lax.cond(      # skipped when no slot may draft past the M MTP drafts
                uniform_any(draft_budget > M),
                lambda: extend_with_ngram(state.input_ids, new_seq_len, mtp_drafts, draft_budget,
                                          ngram_max, ngram_min),
                lambda: mtp_drafts)
            if draft_probs is not None:   # n-gram drafts are deterministic: one-hot q
                from_ngram = (jnp.arange(K)[None] >= ec.m) & (drafts >= 0)
                one_hot = jax.nn.one_hot(jnp.maximum(drafts, 0), draft_probs.shape[-1],
                                         dtype=draft_probs.dtype)
                draft_probs = jnp.where(from_ngram[..., None], one_hot, draft_probs)
    elif ec.spec.method == "ngram" and K > 0:
        # skipped at run time when no slot may draft (e.g. the dynamic policy chose 0 everywhere)
        drafts = jax.lax.cond(
            uniform_any(draft_budget > 0),
            lambda: ngram_match(state.input_ids, new_seq_len, draft_budget, ngram_max, ngram_min,
                                K)[0],
            lambda: drafts)
    elif K > 0:
        drafts = drafter(state).astype(jnp.int32)
    return drafts, draft_probs, mtp_cache


def engine_step(
    graphdef: nnx.GraphDef,     # static: the LlamaForCausalLM's graph definition (nnx.split)
    ec: EngineConfig,
    drafter,                    # None (MTP head / no speculation) or callable(state) -> i32[B, K]
    bucket: StepBucket | int,   # static (T, A) bucket; an int T means A = max_num_seqs
    attention_impl: str | None,
    model_state: nnx.State,     # the model's arrays (nnx.split)
    state: EngineState,
    cache: KVCache,             # target cache (L layers)
    mtp_cache: KVCache | None,  # MTP cache (num_mtp_layers), None without MTP
    prefill_chunk: jax.Array,   # i32[B] prompt tokens each prefilling slot processes this step
    draft_limit: jax.Array | None = None,  # i32[B] max drafts proposed for the next step
):
    """One engine step: the stages of the module docstring, in order.

    The model comes as ``nnx.split``'s pure pair: ``graphdef`` (static, hashable; its
    :class:`~jmtp.model.config.ModelConfig` included) and ``model_state`` (traced arrays), merged
    back into a :class:`~jmtp.model.modules.LlamaForCausalLM` inside the trace; the stages call
    its methods. :class:`~jmtp.runtime.llm_engine.LLMEngine` splits the model once at load.

    Args:
      graphdef, ec, drafter, bucket, attention_impl: static (hashable) arguments. ``bucket`` is
        the :class:`~jmtp.runtime.buckets.StepBucket` ``(T, A)`` the host picked
        (:func:`~jmtp.runtime.buckets.choose_bucket`): T token rows, at least
        ``sum(seq_lens_this_time)``, and A slot rows, at least the number of slots with work; the
        window logits, verification and MTP substeps run over those A compacted slots only. An int
        is taken as T with ``A = max_num_seqs``.
      model_state: the model's ``nnx.State`` (with an MTP head when drafting with it).
      state, cache, mtp_cache: donated by :class:`~jmtp.runtime.llm_engine.LLMEngine`; returned
        updated.
      prefill_chunk: i32[B] prompt tokens each prefilling slot processes this step (clipped to
        what is left of its prompt; ignored for decoding and idle slots).
      draft_limit: i32[B] or None: at most this many drafts are proposed per slot for the next
        step (the dynamic speculation policy's choice, :mod:`jmtp.runtime.spec_policy`); data,
        so new limits never recompile. None = K.

    Returns:
      ``(state, cache, mtp_cache, StepOutput)``.

    Raises:
      ValueError: at trace time, if ``bucket.num_slots`` is outside ``[1, max_num_seqs]``.
    """
    B = ec.max_num_seqs
    if not isinstance(bucket, StepBucket):
        bucket = StepBucket(int(bucket), B)
    if not 1 <= bucket.num_slots <= B:
        raise ValueError(f"StepBucket.num_slots={bucket.num_slots} must lie in "
                         f"[1, max_num_seqs={B}]")
    model = nnx.merge(graphdef, model_state)
    prev = state
    sched = schedule(ec, prev, prefill_chunk)
    blocks, sched = allocate_blocks(ec, prev.blocks, sched, prev.seq_lens_decoder,
                                    prev.num_shared)
    target, cache = target_forward(ec, bucket, attention_impl, model, prev, sched,
                                   effective_block_tables(prev, blocks.block_tables), cache)
    verified = speculate_verify(model.cfg, ec, prev, sched, target)
    state, done = speculate_update(ec, prev, sched, verified, blocks)
    budget = done.draft_budget
    if draft_limit is not None:
        budget = jnp.minimum(budget, jnp.maximum(draft_limit, 0))
    drafts, draft_probs, mtp_cache = _propose(ec, drafter, bucket.num_tokens, attention_impl,
                                              model, state, prev.seq_lens_decoder, target,
                                              budget, mtp_cache)
    state = draft_model_postprocess(ec, state, prev, drafts, draft_probs, budget)
    if not ec.enable_prefix_caching:   # with the cache the host retires slots (retire_slot)
        state = release_finished(ec, state, done.finished)
    num_next_drafts = jnp.sum(state.draft_tokens[:, 1:] >= 0, axis=1).astype(jnp.int32)
    out = StepOutput(tokens=done.tokens, num_tokens=done.num_tokens, num_drafts=sched.num_drafts,
                     num_accepted=done.num_accepted, finished=done.finished,
                     finish_reason=done.finish_reason, paused=sched.paused,
                     free_count=state.free_count, num_next_drafts=num_next_drafts,
                     num_allowed=jnp.where(sched.decoding, prev.actual_draft_token_num,
                                           0).astype(jnp.int32),
                     logprobs=verified.logprobs,
                     top_logprob_ids=verified.top_logprob_ids, top_logprobs=verified.top_logprobs)
    return state, cache, mtp_cache, out


def release_slot(ec: EngineConfig, state: EngineState, slot: jax.Array) -> EngineState:
    """Preempt ``slot`` (i32[]): return its KV blocks (allocator ``ec.block_allocator``) and mark
    it idle (the host re-queues the request). With prefix caching its shared prefix pages are
    dropped from the slot too (the host drops its references)."""
    B = state.stop_flags.shape[0]
    state = release_finished(ec, state, jnp.arange(B) == slot)
    state = _clear_shared(state, slot)
    return dataclasses.replace(state, stop_flags=state.stop_flags.at[slot].set(True))


def _clear_shared(state: EngineState, slot: jax.Array) -> EngineState:
    if state.num_shared is None:
        return state
    return dataclasses.replace(state, num_shared=state.num_shared.at[slot].set(0),
                               shared_tables=state.shared_tables.at[slot].set(-1))


def retire_slot(ec: EngineConfig, state: EngineState, slot: jax.Array, keep: jax.Array
                ) -> tuple[EngineState, jax.Array]:
    """Empty ``slot`` (i32[]) for prefix caching: its owned blocks ``j`` with ``keep[j]``
    (``bool[P]``, indices into the slot's owned blocks ``block_tables[slot, :num_owned]``) leave
    the allocator, pinned for the host's prefix cache; the others go back to the free stack
    (allocator ``ec.block_allocator``, the same release as :func:`release_slot`). The slot's
    shared prefix pages are dropped and it is marked idle.

    Returns:
      ``(state, kept i32[P])``: the kept block ids in table order, -1 padded (entries of ``keep``
      at or past ``num_owned`` are ignored).

    Afterwards ``free_count + sum(num_owned) + (pinned blocks) == num_blocks``; pinned blocks come
    back with :func:`push_free_blocks`.
    """
    tables, owned = state.blocks.block_tables, state.blocks.num_owned
    P = tables.shape[1]
    row = tables[slot]
    j = jnp.arange(P, dtype=jnp.int32)
    # 0: owned, released; 1: owned, kept; 2: not owned. Stable sorts keep table order.
    key = jnp.where(j < owned[slot], keep.astype(jnp.int32), 2)
    release_row = row[jnp.argsort(key, stable=True)]
    n_release = jnp.sum(key == 0).astype(jnp.int32)
    n_kept = jnp.sum(key == 1)
    kept = jnp.where(j < n_kept, row[jnp.argsort(key != 1, stable=True)], -1)
    blocks = dataclasses.replace(
        state.blocks, block_tables=tables.at[slot].set(jnp.where(j < n_release, release_row, -1)),
        num_owned=owned.at[slot].set(n_release))
    state = release_slot(ec, dataclasses.replace(state, blocks=blocks), slot)
    return state, kept.astype(jnp.int32)


def push_free_blocks(state: EngineState, ids: jax.Array) -> EngineState:
    """Give pinned blocks back to the allocator: push the ids ``>= 0`` of ``ids i32[n]`` (in
    order) onto the free stack. For blocks the host's prefix cache evicts; the caller
    guarantees they are neither free nor owned (the allocator's invariants then hold again)."""
    fs, fc = state.blocks.free_stack, state.blocks.free_count
    valid = ids >= 0
    dst = jnp.where(valid, fc + jnp.cumsum(valid) - 1, fs.shape[0])
    fs = fs.at[dst].set(ids, mode="drop")
    blocks = dataclasses.replace(state.blocks, free_stack=fs,
                                 free_count=(fc + jnp.sum(valid)).astype(jnp.int32))
    return dataclasses.replace(state, blocks=blocks)
