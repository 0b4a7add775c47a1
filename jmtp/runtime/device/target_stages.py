"""The target model's stages of the engine step (FastDeploy's target model runner
``execute_model`` up to ``post_process_specualate``): :func:`schedule` the slots (prefill chunk or
verify window), :func:`allocate_blocks` (the KV block top-up), :func:`target_forward` over the
packed ragged batch, :func:`speculate_verify` the drafts and :func:`speculate_update` (commit,
stops decided by :func:`truncate_at_stop`). Each is a pure, jittable function of typed pytrees;
:func:`jmtp.runtime.device.step.engine_step` wires them (its docstring maps each stage to its FastDeploy
op). Also here: :func:`pytree_dataclass`, the decorator of every stage output, and the
compacted-slot helpers the drafting stages share (:func:`take_rows`, :func:`gather_slots`,
:func:`scatter_slots`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jmtp.model.config import ModelConfig
from jmtp.model.llama import KVCache
from jmtp.model.metadata import packed_row_seq, ragged_batch
from jmtp.model.modules import LlamaForCausalLM
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.bitmask import apply_token_bitmask
from jmtp.runtime.device.buckets import StepBucket, active_slots
from jmtp.runtime.device.linear_rules import linear_rules_for
from jmtp.runtime.device.sampling import update_history
from jmtp.runtime.device.sharding import uniform_any
from jmtp.runtime.device.spec import StepSpec
from jmtp.runtime.device.state import FINISH_LENGTH, FINISH_NONE, FINISH_STOP, EngineState
from jmtp.runtime.device.verify import verify

from jmtp.pallas.block_allocator import BlockAllocatorState, blocks_needed


def pytree_dataclass(cls):
    """Frozen dataclass registered as a pytree whose fields are all data (no static fields)."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@pytree_dataclass
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


@pytree_dataclass
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
                                   (:func:`~jmtp.runtime.device.buckets.active_slots`).
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
        return take_rows(self.logit_rows, rows).reshape(A, width, -1)


@pytree_dataclass
class Verified:
    """Output of :func:`speculate_verify` (per slot, before stop truncation).

    Attributes:
      accept_tokens: i32[B, K+1]   accepted drafts then the correction / bonus token (>= 0; the
                                   entries at and past ``accept_num`` are meaningless). A resumed
                                   request's first token is its ``resume_token``.
      accept_num: i32[B]           tokens to emit: ``1 + accepted drafts`` for a decoding slot, 1
                                   for the step that finishes a prefill, else 0.
      num_accepted: i32[B]         drafts accepted (meaningful for decoding slots only).
      logprobs, top_logprob_ids, top_logprobs: as :class:`~jmtp.runtime.device.step.StepOutput` (None
        without logprobs).
    """

    accept_tokens: jax.Array
    accept_num: jax.Array
    num_accepted: jax.Array
    logprobs: jax.Array | None = None
    top_logprob_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


@pytree_dataclass
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



def take_rows(x, rows):
    """Rows ``rows`` (i32[R], clipped into range) of ``x [N, ...]``."""
    return jnp.take(x, jnp.clip(rows, 0, x.shape[0] - 1), axis=0)


def gather_slots(tree, sl):
    """Rows ``sl`` (i32[A], in range) of every ``[B, ...]`` leaf of ``tree``."""
    return jax.tree_util.tree_map(lambda x: x[sl], tree)


def scatter_slots(x, slots, num_seqs, fill=0):
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
    overhang = max(ec.mtp_substeps - 1, 0)
    need = jnp.where(query_lens > 0,
                     blocks_needed(seq_lens_decoder + query_lens + overhang, ec.block_size), 0)
    if num_shared is not None:
        need = jnp.where(query_lens > 0, jnp.maximum(need - num_shared, 0), 0)
    blocks, paused = blocks.allocate(jnp.zeros((B,), bool), need.astype(jnp.int32),
                                     implementation=ec.block_allocator,
                                     platform=ec.platform)
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


def target_forward(spec: StepSpec, model: LlamaForCausalLM, state: EngineState, sched: Schedule,
                   block_tables: jax.Array, cache: KVCache) -> tuple[TargetOutput, KVCache]:
    """Target forward over the packed ragged batch, then the logits of the window rows only
    (``min(T, A·(K+1))`` LM-head rows: a step of slots that drafted nothing costs the LM head of
    a plain step).

    Row ``t`` of the packed batch is query ``local`` of slot ``seq``: a prompt token
    (``input_ids[seq, seq_lens_decoder[seq] + local]``) for a prefill chunk and for position 0 of a verify window
    (the last accepted token, already in ``input_ids``), else draft ``draft_tokens[seq, local]``.

    Args:
      spec: the step's static :class:`~jmtp.runtime.device.spec.StepSpec`: its engine config,
        its bucket's (T, A) sizes (requires ``sum(seq_lens_this_time) <= T`` and at most A slots
        with work) and its attention backend.
      model: the target (its ``__call__`` and ``logits``).
      block_tables: i32[B, P] after :func:`allocate_blocks`.

    Returns:
      ``(TargetOutput, updated target cache)``.
    """
    ec, bucket = spec.engine, spec.bucket
    B, W = ec.max_num_seqs, ec.window
    num_tokens, A = bucket.num_tokens, bucket.num_slots
    query_lens, prefill_lens = sched.seq_lens_this_time, sched.seq_lens_encoder
    decoded = state.seq_lens_decoder
    positions, meta = ragged_batch(query_lens, decoded, block_tables, ec.block_size, num_tokens,
                                   window_rows_hint(ec, bucket))
    if model.cfg.is_hybrid:
        packed_rule, chunk_rule = linear_rules_for(ec.platform)
        meta = dataclasses.replace(meta, linear_rule=packed_rule, linear_chunk_rule=chunk_rule)
    cu_q_lens = meta.cu_q_lens
    seq, local = packed_row_seq(cu_q_lens, num_tokens)
    from_prompt = sched.prefilling[seq] | (local == 0)
    ids = jnp.where(from_prompt,
                    state.input_ids[seq, jnp.clip(decoded[seq] + local, 0, ec.seq_buffer_len - 1)],
                    state.draft_tokens[seq, jnp.clip(local, 0, W - 1)])
    ids = jnp.clip(ids, 0, model.cfg.vocab_size - 1)
    hidden, cache = model(ids, positions, meta, cache, spec.attention)

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
        logit_rows = model.target_logits(take_rows(hidden, rows.reshape(-1)))
        window_rows = jnp.arange(A * W, dtype=jnp.int32).reshape(A, W)
    return TargetOutput(hidden=hidden, cu_q_lens=cu_q_lens, logit_rows=logit_rows,
                        window_rows=window_rows, slots=slots, valid=valid), cache


def speculate_verify(mc: ModelConfig, ec: EngineConfig, state: EngineState, sched: Schedule,
                     target: TargetOutput, token_bitmask: jax.Array | None = None) -> Verified:
    """Verify each decoding slot's drafts against the target's window logits (penalties,
    min_tokens and bad words applied at every row; strategy ``ec.spec.verify_strategy``, see
    :func:`jmtp.runtime.device.verify.verify`), and take the first token of a slot whose prefill ends.
    ``token_bitmask`` (``i32[B, K+1, ceil(V/32)]`` or None) masks each window row's logits first
    (structured outputs; :func:`~jmtp.runtime.device.bitmask.apply_token_bitmask`).

    Returns:
      :class:`Verified` over the B slots (no stop truncation: :func:`speculate_update` does it).
    """
    B = ec.max_num_seqs
    prev = state   # the state the step started from
    slots, valid = target.slots, target.valid
    slot_rows = jnp.minimum(slots, B - 1)
    sampling = gather_slots(prev.sampling, slot_rows)
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
        logits = target.window_logits(width)
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits, token_bitmask[slot_rows, :width])
        res = verify(logits, prev.draft_tokens[slot_rows, 1:width],
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
    result = jax.tree_util.tree_map(lambda x: scatter_slots(x, slots, B), result)
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
