"""The engine step: one jitted pure function doing target forward + verify + update + the whole
multi-step MTP proposal + KV-block bookkeeping (FastDeploy ``execute_model`` speculative branch,
§2 of the spec, with the "shadow state" MTP of §12 Q2).

Order inside :func:`engine_step`:

1. schedule: per slot, prefill chunk (host-chosen) or verify window ``[last, d1..dn]``;
2. KV blocks: allocate what this step's target and MTP writes need (paused if none free);
3. target forward over the packed ragged batch (``pre_process`` + model), logits of the window rows
   only (``rebuild_padding`` + ``compute_logits``);
4. verify (greedy: longest prefix of drafts equal to the target argmax, then the bonus token);
5. ``speculate_update``: stop on stop tokens / max_tokens / max_model_len, truncating at the first stop
   inside the accepted tokens; append tokens; advance ``seq_lens_decoder`` and ``step_idx``;
6. proposer: MTP substep 0 over the accepted tokens paired with the target's hidden rows
   (``draft_model_preprocess`` + ``eagle_get_hidden_states``), then substeps 1..M-1 fed the MTP's
   own hidden state (``eagle_get_self_hidden_states``); drafts written to ``draft_tokens[:, 1:]``
   (``draft_model_update`` / ``draft_model_postprocess``);
7. release the blocks of slots that finished.

The MTP keeps no state besides its cache: it processes positions ``[dec_old, dec_old + a)`` of the
one-position-shifted cache (position p holds (x_{p+1}, h_p)), i.e. its ``seq_lens_decoder`` is the
target's minus ``accept_num`` (§12 Q2 "shadow state"). Speculative positions written by substeps
≥ 1 lie past the next step's kv length and are overwritten before they are ever read.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jmtp.model.config import ModelConfig
from jmtp.model.llama import KVCache, compute_logits, forward, mtp_forward
from jmtp.model.metadata import ragged_batch
from jmtp.runtime.buckets import StepBucket, active_slots
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.ngram import extend_with_ngram, ngram_match
from jmtp.runtime.sampling import draft_sample, update_history
from jmtp.runtime.state import FINISH_LENGTH, FINISH_NONE, FINISH_STOP, EngineState
from jmtp.runtime.verify import verify

from jmtp.pallas.block_allocator import allocate_blocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutput:
    """What the host reads back after each step (small arrays only).

    Attributes:
      tokens: i32[B, K+1]      emitted tokens, -1 past ``num_tokens``.
      num_tokens: i32[B]       tokens committed this step (0 for idle / mid-prefill / paused slots).
      num_drafts: i32[B]       drafts verified this step.
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
    logprobs: jax.Array | None = None
    top_logprob_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def _take_rows(x, rows):
    return jnp.take(x, jnp.clip(rows, 0, x.shape[0] - 1), axis=0)


def _gather_slots(tree, sl):
    """Rows ``sl`` (i32[A], in range) of every ``[B, ...]`` leaf of ``tree``."""
    return jax.tree_util.tree_map(lambda x: x[sl], tree)


def _scatter_slots(x, slots, num_seqs, fill=0):
    """``[B, ...]`` array of ``fill`` holding row ``i`` of ``x [A, ...]`` at slot ``slots[i]``;
    padding rows (``slots[i] == B``) are dropped."""
    return jnp.full((num_seqs,) + x.shape[1:], fill, x.dtype).at[slots].set(x, mode="drop")


def model_step(graphdef: nnx.GraphDef, mc: ModelConfig, ec: EngineConfig, drafter, bucket,
               attention_impl: str | None, model_state: nnx.State, *args, **kwargs):
    """:func:`engine_step` on an NNX model given as ``nnx.split``'s pure ``(graphdef, state)``.

    ``graphdef`` is bound once (``functools.partial``) by :class:`~jmtp.runtime.llm_engine.LLMEngine`;
    ``model_state`` (the :class:`~jmtp.model.modules.LlamaForCausalLM` state: arrays only) is a
    traced argument, merged back into the module inside the trace. The module's parameter dict
    names the same traced arrays, so the step compiles to the same graph as :func:`engine_step`
    on that dict. Other arguments and the return value are :func:`engine_step`'s.
    """
    params = nnx.merge(graphdef, model_state).to_params()
    return engine_step(mc, ec, drafter, bucket, attention_impl, params, *args, **kwargs)


def engine_step(
    mc: ModelConfig,
    ec: EngineConfig,
    drafter,                    # None (MTP head / no speculation) or callable(state) -> i32[B, K]
    bucket: StepBucket | int,   # static (T, A) bucket; an int T means A = max_num_seqs
    attention_impl: str | None,
    params: dict,
    state: EngineState,
    cache: KVCache,             # target cache (L layers)
    mtp_cache: KVCache | None,  # MTP cache (num_mtp_layers), None without MTP
    prefill_chunk: jax.Array,   # i32[B] prompt tokens each prefilling slot processes this step
    draft_limit: jax.Array | None = None,  # i32[B] max drafts proposed for the next step
):
    """One engine step (see module docstring).

    Args:
      mc, ec, drafter, bucket, attention_impl: static (hashable) arguments. ``bucket`` is the
        :class:`~jmtp.runtime.buckets.StepBucket` ``(T, A)`` the host picked
        (:func:`~jmtp.runtime.buckets.choose_bucket`): T token rows, at least
        ``sum(seq_lens_this_time)``, and A slot rows, at least the number of slots with work; the
        window logits, verification and MTP substeps run over those A compacted slots only. An int
        is taken as T with ``A = max_num_seqs``.
      params: model parameter pytree (with ``params["mtp"]`` when drafting with the MTP head).
      state, cache, mtp_cache: donated by :class:`~jmtp.runtime.engine.LLM`; returned updated.
      prefill_chunk: i32[B] prompt tokens each prefilling slot processes this step (clipped to
        what is left of its prompt; ignored for decoding and idle slots).
      draft_limit: i32[B] or None: at most this many drafts are proposed per slot for the next
        step (the dynamic speculation policy's choice, :mod:`jmtp.runtime.spec_policy`); data,
        so new limits never recompile. None = K.

    Returns:
      ``(state, cache, mtp_cache, StepOutput)``.
    """
    B, W, K, M, bs = ec.max_num_seqs, ec.window, ec.k, ec.m, ec.block_size
    if not isinstance(bucket, StepBucket):
        bucket = StepBucket(int(bucket), B)
    num_tokens, A = bucket.num_tokens, bucket.num_slots
    if not 1 <= A <= B:
        raise ValueError(f"StepBucket.num_slots={A} must lie in [1, max_num_seqs={B}]")
    s = state
    use_mtp = ec.m > 0          # the MTP head drafts (not n-gram, not a custom drafter)
    running = ~s.stop_flags
    dec = s.seq_lens_decoder
    prefilling = running & (dec < s.prompt_lens)
    decoding = running & ~prefilling
    chunk = jnp.where(prefilling, jnp.minimum(prefill_chunk, s.prompt_lens - dec), 0)
    num_drafts = jnp.where(decoding, jnp.sum(s.draft_tokens[:, 1:] >= 0, axis=1), 0)
    slt = jnp.where(prefilling, chunk, jnp.where(decoding, 1 + num_drafts, 0)).astype(jnp.int32)

    # ---- 2. KV blocks for this step's writes: target [dec, dec+slt), MTP up to dec+slt+M-2.
    overhang = max(M - 1, 0) if use_mtp else 0
    need = jnp.where(slt > 0, -(-(dec + slt + overhang) // bs), 0)
    alloc = allocate_blocks(s.free_stack, s.free_count, s.block_tables, s.num_owned,
                            jnp.zeros((B,), bool), need)
    paused = alloc.paused & (slt > 0)
    slt = jnp.where(paused, 0, slt)
    chunk = jnp.where(paused, 0, chunk)
    num_drafts = jnp.where(paused, 0, num_drafts)
    prefilling = prefilling & ~paused
    decoding = decoding & ~paused
    tables = alloc.block_tables

    # ---- 3. target forward over the packed batch.
    positions, meta = ragged_batch(slt, dec, tables, bs, num_tokens)
    cu = meta.cu_q_lens
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, B - 1)
    local = t - cu[seq]
    from_prompt = prefilling[seq] | (local == 0)
    ids = jnp.where(from_prompt,
                    s.input_ids[seq, jnp.clip(dec[seq] + local, 0, ec.seq_buffer_len - 1)],
                    s.draft_tokens[seq, jnp.clip(local, 0, W - 1)])
    ids = jnp.clip(ids, 0, mc.vocab_size - 1)
    hidden, cache = forward(mc, params, ids, positions, meta, cache, attention_impl)

    # Compact the slots with work into A rows (slot ids ascending, then padding = B); logits and
    # verification run over those rows only and are scattered back to [B, ...].
    slots, valid_a = active_slots(slt > 0, A)
    sl = jnp.minimum(slots, B - 1)                                       # in-range gather index

    # Window rows: all 1+n rows of a verify window; the last row of a prefill chunk.
    w = jnp.arange(W, dtype=jnp.int32)
    rows = jnp.where(prefilling[sl, None], cu[sl, None] + chunk[sl, None] - 1,
                     cu[sl, None] + w[None])                             # i32[A, W]
    h_win = _take_rows(hidden, rows.reshape(-1))
    logits = compute_logits(params, h_win).reshape(A, W, -1)

    # ---- 4. verify (penalties, min_tokens, bad words at every window row; see verify.py).
    res = verify(logits, s.draft_tokens[sl, 1:], jnp.where(valid_a, num_drafts[sl], 0),
                 None if s.draft_probs is None else s.draft_probs[sl],
                 _gather_slots(s.sampling, sl), s.step_idx[sl],
                 jnp.asarray(mc.eos_token_ids or (-1,), jnp.int32), strategy=ec.spec.verify_strategy,
                 max_candidate_len=ec.spec.max_candidate_len, verify_window=ec.spec.verify_window,
                 num_logprobs=ec.max_logprobs, truncate_at_stop=False)
    res = jax.tree_util.tree_map(lambda x: _scatter_slots(x, slots, B), res)
    target_tok = jnp.maximum(res.accept_tokens, 0)
    n_acc = res.accept_num - 1
    finishing_prefill = prefilling & (dec + chunk == s.prompt_lens)
    # A request resumed after a preemption re-emits its last token (insert_request's resume_token).
    resume = finishing_prefill & (s.draft_tokens[:, 0] >= 0)
    target_tok = target_tok.at[:, 0].set(jnp.where(resume, s.draft_tokens[:, 0], target_tok[:, 0]))
    emit = jnp.where(finishing_prefill, 1, jnp.where(decoding, n_acc + 1, 0))

    # ---- 5. speculate_update: stop checks per emitted token, truncation at the first stop.
    seq_len = s.prompt_lens + s.step_idx                                  # tokens in the sequence
    valid = w[None] < emit[:, None]
    stop_ids = s.sampling.stop_token_ids
    is_stop_tok = jnp.any((target_tok[:, :, None] == stop_ids[:, None, :])
                          & (stop_ids[:, None, :] >= 0), axis=-1)
    is_stop_tok &= (s.step_idx[:, None] + w[None] + 1) > s.sampling.min_tokens[:, None]
    is_len = ((s.step_idx[:, None] + w[None] + 1) >= s.max_dec_len[:, None]) | (
        (seq_len[:, None] + w[None] + 1) >= ec.max_model_len)
    stop_at = valid & (is_stop_tok | is_len)
    any_stop = jnp.any(stop_at, axis=1)
    first = jnp.argmax(stop_at, axis=1)
    emit = jnp.where(any_stop, first + 1, emit).astype(jnp.int32)
    reason = jnp.where(jnp.take_along_axis(is_stop_tok, first[:, None], 1)[:, 0],
                       FINISH_STOP, FINISH_LENGTH)
    valid = w[None] < emit[:, None]
    tokens = jnp.where(valid, target_tok, -1)
    num_accepted = jnp.where(decoding, jnp.minimum(n_acc, emit), 0)

    write_at = jnp.where(valid, seq_len[:, None] + w[None], ec.seq_buffer_len)
    input_ids = s.input_ids.at[jnp.arange(B)[:, None], write_at].set(tokens, mode="drop")
    step_idx = s.step_idx + emit
    new_dec = jnp.where(prefilling, dec + chunk, jnp.where(decoding, dec + emit, dec))
    last_tok = jnp.take_along_axis(tokens, jnp.clip(emit - 1, 0, W - 1)[:, None], 1)[:, 0]
    finished = any_stop
    stop_flags = s.stop_flags | finished
    draft0 = jnp.where(emit > 0, last_tok, s.draft_tokens[:, 0])

    # Drafts allowed next step: never past max_tokens or max_model_len (§12 Q3).
    new_seq_len = s.prompt_lens + step_idx
    allowed = jnp.clip(jnp.minimum(s.max_dec_len - step_idx - 1, ec.max_model_len - new_seq_len - 1),
                       0, K)
    can_draft = ~stop_flags & (new_dec >= s.prompt_lens) & (emit > 0)
    allowed = jnp.where(can_draft, allowed, 0)

    state = dataclasses.replace(
        s, input_ids=input_ids, seq_lens_encoder=chunk, seq_lens_decoder=new_dec,
        seq_lens_this_time=slt, step_idx=step_idx, accept_tokens=tokens, accept_num=emit,
        num_drafts=num_drafts, stop_flags=stop_flags,
        sampling=update_history(s.sampling, tokens, emit),
        finish_reason=jnp.where(finished, reason, s.finish_reason),
        block_tables=tables, num_owned=alloc.num_owned, paused=paused,
        free_stack=alloc.free_stack, free_count=alloc.free_count,
        draft_tokens=jnp.full((B, W), -1, jnp.int32).at[:, 0].set(draft0))

    # ---- 6. proposer.
    if draft_limit is not None:
        allowed = jnp.minimum(allowed, jnp.maximum(draft_limit, 0))
    drafts = jnp.full((B, K), -1, jnp.int32)
    q = None
    ng_min, ng_max = ec.spec.ngram_sizes
    if use_mtp:
        drafts, q, mtp_cache = _mtp_propose(mc, ec, params, state, mtp_cache, hidden, cu, dec,
                                         prefilling, chunk, decoding, emit, allowed, num_tokens,
                                         attention_impl, slots, valid_a)
        if ng_max:      # hybrid_mtp_ngram: n-gram tokens extend the M MTP drafts up to K
            mtp_drafts = jnp.where(jnp.arange(K)[None] < allowed[:, None], drafts, -1)
            drafts = extend_with_ngram(state.input_ids, new_seq_len, mtp_drafts, allowed,
                                       ng_max, ng_min)
            if q is not None:   # n-gram drafts are deterministic: one-hot q (exact rejection)
                from_ngram = (jnp.arange(K)[None] >= ec.m) & (drafts >= 0)
                q = jnp.where(from_ngram[..., None],
                              jax.nn.one_hot(jnp.maximum(drafts, 0), q.shape[-1], dtype=q.dtype), q)
    elif ec.spec.method == "ngram" and K > 0:
        drafts, _ = ngram_match(state.input_ids, new_seq_len, allowed, ng_max, ng_min, K)
    elif K > 0:
        drafts = drafter(state).astype(jnp.int32)
    drafts = jnp.where(jnp.arange(K)[None] < allowed[:, None], drafts, -1)
    # Drafts are a prefix: stop at the first missing one.
    present = jnp.cumprod((drafts >= 0).astype(jnp.int32), axis=1) > 0
    drafts = jnp.where(present, drafts, -1)
    # A paused slot did nothing this step: it keeps its window for the retry.
    new_window = state.draft_tokens.at[:, 1:].set(drafts)
    state = dataclasses.replace(
        state, draft_tokens=jnp.where(paused[:, None], s.draft_tokens, new_window))
    if ec.spec.draft_sampling:
        q = q if q is not None else jnp.zeros_like(s.draft_probs)
        state = dataclasses.replace(
            state, draft_probs=jnp.where(paused[:, None, None], s.draft_probs, q))

    # ---- 7. release the blocks of slots that finished this step.
    rel = allocate_blocks(state.free_stack, state.free_count, state.block_tables, state.num_owned,
                          finished, jnp.zeros((B,), jnp.int32))
    state = dataclasses.replace(state, free_stack=rel.free_stack, free_count=rel.free_count,
                                block_tables=rel.block_tables, num_owned=rel.num_owned)
    out = StepOutput(tokens=tokens, num_tokens=emit, num_drafts=num_drafts,
                     num_accepted=num_accepted, finished=finished,
                     finish_reason=jnp.where(finished, reason, FINISH_NONE), paused=paused,
                     free_count=state.free_count,
                     num_next_drafts=jnp.sum(state.draft_tokens[:, 1:] >= 0, axis=1).astype(jnp.int32),
                     logprobs=res.logprobs,
                     top_logprob_ids=res.top_logprob_ids, top_logprobs=res.top_logprobs)
    return state, cache, mtp_cache, out


def _mtp_propose(mc, ec, params, state, mtp_cache, hidden, cu_t, dec, prefilling, chunk, decoding,
                 emit, allowed, num_tokens, attention_impl, slots, valid_a):
    """MTP proposer: substep 0 over this step's committed positions, substeps 1..M-1 recursive.

    Substep 0 processes MTP positions ``p in [dec_old, dec_old + q)`` with tokens
    ``input_ids[p + 1]`` (prompt tokens, then the tokens just committed) and the target's hidden row
    of position p; ``q`` is the prefill chunk or ``accept_num``. The draft picks and substeps
    1..M-1 run over the A compacted slots ``slots i32[A]`` (``valid_a bool[A]``, see
    :func:`~jmtp.runtime.buckets.active_slots`). Returns ``(drafts i32[B, K],
    draft_probs f32[B, K, V] | None, cache)``.
    """
    B, K, M, bs = ec.max_num_seqs, ec.k, ec.m, ec.block_size
    # ---- slot compaction (row-count plumbing): every per-slot array below is over the A rows.
    A = slots.shape[0]
    sl = jnp.minimum(slots, B - 1)
    sampling_a, step_idx_a = _gather_slots(state.sampling, sl), state.step_idx[sl]
    tables_a, allowed_a = state.block_tables[sl], jnp.where(valid_a, allowed[sl], 0)
    n_layers = max(mc.num_mtp_layers, 1)
    q = jnp.where(state.stop_flags, 0, jnp.where(prefilling, chunk, jnp.where(decoding, emit, 0)))
    positions, meta = ragged_batch(q, dec, state.block_tables, bs, num_tokens)
    cu = meta.cu_q_lens
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, B - 1)
    local = t - cu[seq]
    ids = state.input_ids[seq, jnp.clip(positions + 1, 0, ec.seq_buffer_len - 1)]
    ids = jnp.clip(ids, 0, mc.vocab_size - 1)
    h_in = _take_rows(hidden, cu_t[seq] + local)
    h_log, h_next, mtp_cache = mtp_forward(mc, params, 0, ids, h_in, positions, meta, mtp_cache,
                                           attention_impl)
    last = cu[sl] + q[sl] - 1                                           # i32[A]

    def pick(h_rows, sub, needed):
        """Draft ``sub`` (0-based), skipped at run time (``lax.cond``) when no slot needs it (all
        draft limits below ``sub + 1``): saves the draft LM head."""
        def run(h_rows):
            return _pick(h_rows, sub)

        def skip(h_rows):
            tok = jnp.zeros((h_rows.shape[0],), jnp.int32)
            if not ec.spec.draft_sampling:
                return tok, None
            return tok, jnp.zeros((h_rows.shape[0], mc.vocab_size), jnp.float32)
        return jax.lax.cond(jnp.any(needed), run, skip, h_rows)

    def _pick(h_rows, sub):
        """Draft ``sub`` (0-based): argmax, or a sample with its exact distribution q."""
        if "draft_head" in params:    # FR-Spec: score the N-token draft vocabulary only
            logits = jnp.dot(h_rows, params["draft_head"].T, preferred_element_type=jnp.float32)
        else:
            logits = compute_logits(params, h_rows)
        tok, probs = draft_sample(
            logits, sampling_a, step_idx_a + sub,
            draft_sampling=ec.spec.draft_sampling, draft_temperature=ec.spec.draft_temperature,
            draft_top_p=ec.spec.draft_top_p, draft_top_k=ec.spec.draft_top_k)
        if "draft_head" in params:    # back to full-vocabulary ids (q is zero off the N tokens)
            tok = params["draft_ids"][tok]
            if probs is not None:
                probs = jnp.zeros((probs.shape[0], mc.vocab_size), probs.dtype).at[
                    :, params["draft_ids"]].set(probs)
        return tok.astype(jnp.int32), (None if probs is None else probs.astype(jnp.float32))

    active = allowed_a > 0
    d, probs = pick(_take_rows(h_log, last), 0, active)
    h_prev = _take_rows(h_next, last)
    drafts = [jnp.where(active, d, -1)]
    qs = [probs]
    pos0 = state.seq_lens_decoder[sl]  # MTP position of draft d1 (= target dec after the update)
    for sub in range(1, M):
        active = active & (allowed_a > sub)
        pos_s, meta_s = ragged_batch(active.astype(jnp.int32), pos0 + sub - 1, tables_a, bs, A)
        # Rows are packed in compacted-slot order; row i's token is at cu_s[i] when active.
        rows = jnp.clip(meta_s.cu_q_lens[:A], 0, A - 1)
        scatter = jnp.where(active, rows, A)
        ids_s = jnp.zeros((A,), jnp.int32).at[scatter].set(jnp.clip(d, 0, mc.vocab_size - 1),
                                                             mode="drop")
        h_s = jnp.zeros_like(h_prev).at[scatter].set(h_prev, mode="drop")
        h_log, h_next, mtp_cache = mtp_forward(mc, params, sub % n_layers, ids_s, h_s, pos_s,
                                               meta_s, mtp_cache, attention_impl)
        d, probs = pick(_take_rows(h_log, rows), sub, active)
        h_prev = _take_rows(h_next, rows)
        drafts.append(jnp.where(active, d, -1))
        qs.append(probs)
    drafts = jnp.stack(drafts, axis=1)
    if M < K:
        drafts = jnp.concatenate([drafts, jnp.full((A, K - M), -1, jnp.int32)], axis=1)
    drafts = _scatter_slots(drafts, slots, B, fill=-1)                  # back to i32[B, K]
    q_all = None
    if ec.spec.draft_sampling:
        q_all = jnp.stack(qs, axis=1)
        if M < K:
            q_all = jnp.concatenate([q_all, jnp.zeros((A, K - M, q_all.shape[-1]))], axis=1)
        q_all = _scatter_slots(q_all, slots, B)
    return drafts, q_all, mtp_cache


def release_slot(state: EngineState, slot: jax.Array) -> EngineState:
    """Preempt ``slot``: return its KV blocks and mark it idle (the host re-queues the request)."""
    B = state.stop_flags.shape[0]
    rel = allocate_blocks(state.free_stack, state.free_count, state.block_tables, state.num_owned,
                          jnp.arange(B) == slot, jnp.zeros((B,), jnp.int32))
    return dataclasses.replace(
        state, stop_flags=state.stop_flags.at[slot].set(True),
        free_stack=rel.free_stack, free_count=rel.free_count, block_tables=rel.block_tables,
        num_owned=rel.num_owned)
