"""The engine step: one jitted pure function wired over named, pure stages (the speculative
branch of FastDeploy's target model runner ``execute_model``, with the "shadow state" MTP that
later FastDeploy versions adopted: the MTP's decode state is derived from the target's and
``accept_num``, never rolled back). :func:`engine_step` is the whole step, compiled once per step
bucket with the state and both caches donated; each stage is a function of typed pytrees in →
typed pytrees out, jittable and tested on its own (``tests/runtime/test_stages.py``).

The stages live by job: the target model's in :mod:`jmtp.runtime.device.target_stages`, the proposer's
in :mod:`jmtp.runtime.device.draft_stages`, the KV block release and the host's slot operations in
:mod:`jmtp.runtime.device.slots`. This module wires them and defines :class:`StepOutput`, what the host
reads back.

=========================== ====================================================================
stage (module)              FastDeploy op(s)
=========================== ====================================================================
``schedule``                the ``seq_lens_this_time`` the scheduler / ``draft_model_postprocess``
(target_stages)             set: per slot the prefill chunk (``seq_lens_encoder``) or the verify
                            window ``1 + #drafts`` (the runner copies it into the next
                            step's buffer; request insertion sets a new request's)
``allocate_blocks``         ``speculate_step_paddle`` / ``step_cuda`` block top-up (and the MTP's
(target_stages)             ``mtp_step_paddle``, whose cache shares the block ids here):
                            every scheduled slot gets the blocks its writes need, all or nothing,
                            else it is paused (``is_block_step``)
``target_forward``          ``speculate_get_padding_offset`` + model forward + ``rebuild_padding``
(target_stages)             + ``compute_logits``: window rows only
``speculate_verify``        ``top_p_candidates`` + ``speculate_verify`` (``SpeculativeSampler``)
(target_stages)
``speculate_update``        ``speculate_update`` + ``speculate_set_value_by_flags_and_idx``
(target_stages)             (``post_process_specualate``): stop checks, truncation at the first
                            stop, token append
``draft_model_preprocess``  ``draft_model_preprocess`` + ``eagle_get_hidden_states``: MTP
(draft_stages)              substep 0 inputs from the accepted tokens and target rows
``mtp_substep``             one MTP forward + draft pick, then ``draft_model_update`` +
(draft_stages)              ``eagle_get_self_hidden_states`` (the proposer's ``_propose`` loop
                            and ``MTPSampler``) for the next substep; ``propose`` applies it M
                            times (or runs the n-gram matcher / a custom drafter)
``draft_model_postprocess`` ``draft_model_postprocess``: drafts into
(draft_stages)              ``draft_tokens[:, 1:]``, the next ``seq_lens_this_time``
``release_finished``        the release half of ``speculate_step_paddle``: finished slots
(slots)                     return their blocks in the step they finish
=========================== ====================================================================

The step calls the allocator twice: the top-up at the start (a slot's need depends on this step's
schedule) and the release at the end (a slot's blocks return in the step it finishes, so the host
sees them free at once and an idle engine owns no blocks). Folding the release into the next
step's single call would hold a finished request's blocks for one more step.

With prefix caching (``EngineConfig.enable_prefix_caching``, :mod:`jmtp.runtime.host.prefix_cache`)
a slot may start with read-only cached blocks in front of its owned ones: the stages read every
block table through :func:`~jmtp.runtime.device.state.effective_block_tables`, the top-up counts only
the owned pages, and the final release is left to the host (:func:`~jmtp.runtime.device.slots.retire_slot`
keeps the full blocks it caches; :func:`~jmtp.runtime.device.slots.push_free_blocks` returns evicted
ones), the one-graph step otherwise unchanged.

Every stage output is a frozen dataclass registered with ``jax.tree_util.register_dataclass``;
all fields are data (array leaves, or None for an absent optional array), static sizes live in
:class:`~jmtp.runtime.config.EngineConfig` / :class:`~jmtp.runtime.device.buckets.StepBucket`.

The MTP keeps no state besides its cache: it processes positions ``[dec_old, dec_old + a)`` of the
one-position-shifted cache (position p holds (x_{p+1}, h_p)), i.e. its ``seq_lens_decoder`` is the
target's minus ``accept_num`` (the "shadow state": FastDeploy's own recovery formula subtracted
``seq_lens_this_time``, right only when every draft was accepted). Speculative positions written
by substeps ≥ 1 lie past the next step's kv length and are overwritten before they are ever read.

:func:`release_slot`, :func:`retire_slot`, :func:`push_free_blocks` and :func:`set_slot_state_of`
are re-exported from :mod:`jmtp.runtime.device.slots` (the engine calls them next to
:func:`engine_step`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jmtp.model.gated_deltanet import next_checkpoint
from jmtp.model.state_checkpoints import capture_boundary_states
from jmtp.runtime.device.bitmask import KEEP_DRAFT, override_drafts
from jmtp.runtime.device.draft_stages import draft_model_postprocess
from jmtp.runtime.device.prompt_logprobs import prompt_logprobs
from jmtp.runtime.device.proposers import propose
from jmtp.runtime.device.sharding import uniform_any
from jmtp.runtime.device.slots import (push_free_blocks, release_finished, release_slot,
                                       retire_slot, set_slot_state_of)
from jmtp.runtime.device.spec import Caches, StepInputs, StepSpec
from jmtp.runtime.device.state import EngineState, effective_block_tables
from jmtp.runtime.device.target_stages import (allocate_blocks, schedule, speculate_update,
                                               speculate_verify, target_forward)

__all__ = ["Caches", "StepInputs", "StepOutput", "StepSpec", "engine_step", "push_free_blocks", "release_slot", "retire_slot",
           "set_slot_state_of"]


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
      draft_tokens: i32[B, K]  the drafts of the slot's next verify window (-1 past
                               ``num_next_drafts``); the host's grammar masks them
                               (:mod:`jmtp.runtime.host.structured`).
      prompt_logprobs: f32[T], prompt_top_ids: i32[T, n], prompt_top_logprobs: f32[T, n],
      prompt_row_start: i32[B]  per packed row, the logprob of the context token after it and
                               the row's top-n; each slot's first row (None unless
                               max_logprobs > 0; :mod:`jmtp.runtime.device.prompt_logprobs`).
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
    draft_tokens: jax.Array | None = None
    prompt_logprobs: jax.Array | None = None
    prompt_top_ids: jax.Array | None = None
    prompt_top_logprobs: jax.Array | None = None
    prompt_row_start: jax.Array | None = None


def engine_step(spec: StepSpec, model_state: nnx.State, state: EngineState, caches: Caches,
                inputs: StepInputs) -> tuple[EngineState, Caches, StepOutput]:
    """One engine step: the stages of the module docstring, in order.

    The model comes as ``nnx.split``'s pure pair: ``spec.graphdef`` (static, hashable; its
    :class:`~jmtp.model.config.ModelConfig` included) and ``model_state`` (traced arrays), merged
    back into a :class:`~jmtp.model.modules.LlamaForCausalLM` inside the trace; the stages call
    its methods. :class:`~jmtp.runtime.device.runner.DeviceRunner` splits the model once at load
    and builds every call's arguments (:meth:`~jmtp.runtime.device.runner.DeviceRunner.step_args`).

    Args:
      spec: the static :class:`~jmtp.runtime.device.spec.StepSpec` (graph definition, the shard's
        :class:`~jmtp.runtime.config.EngineConfig`, the
        :class:`~jmtp.runtime.device.buckets.StepBucket` ``(T, A)`` and the resolved attention
        backend; the drafter is ``spec.engine.spec.drafter``). The window logits, verification
        and MTP substeps run over the bucket's A compacted slots only.
      model_state: the model's ``nnx.State`` (with an MTP head when drafting with it).
      state: the :class:`EngineState` (donated; returned updated).
      caches: the target and MTP :class:`~jmtp.runtime.device.spec.Caches` (donated; returned
        updated).
      inputs: the per-step :class:`~jmtp.runtime.device.spec.StepInputs` (``prefill_chunk
        i32[B]``, ``draft_limit i32[B]`` or None = K, ``token_bitmask i32[B, K+1, ceil(V/32)]``
        or None, ``draft_override i32[B, K]`` or None; see there). The target's window logits
        are masked by the bitmask before verification, so greedy and rejection-sampled outputs
        follow the constrained distribution exactly (:mod:`jmtp.runtime.device.bitmask`).

    Returns:
      ``(state, caches, StepOutput)``.
    """
    ec = spec.engine
    cache, mtp_cache = caches.target, caches.mtp
    prefill_chunk, draft_limit = inputs.prefill_chunk, inputs.draft_limit
    token_bitmask, draft_override = inputs.token_bitmask, inputs.draft_override
    model = nnx.merge(spec.graphdef, model_state)
    if draft_override is not None and ec.window > 1:
        def repair(state):
            tokens, probs = override_drafts(state.draft_tokens, state.draft_probs, draft_override)
            count = jnp.sum(tokens[:, 1:] >= 0, axis=1).astype(jnp.int32)
            return dataclasses.replace(
                state, draft_tokens=tokens, draft_probs=probs,
                actual_draft_token_num=jnp.maximum(state.actual_draft_token_num, count))
        # skipped at run time when nothing is overridden (no constrained window)
        state = jax.lax.cond(uniform_any(draft_override != KEEP_DRAFT), repair, lambda s: s,
                             state)
    prev = state
    sched = schedule(ec, prev, prefill_chunk)
    blocks, sched = allocate_blocks(ec, prev.blocks, sched, prev.seq_lens_decoder,
                                    prev.num_shared)
    target, cache = target_forward(spec, model, prev, sched,
                                   effective_block_tables(prev, blocks.block_tables), cache)
    verified = speculate_verify(model.cfg, ec, prev, sched, target, token_bitmask)
    plp = prompt_logprobs(ec, model, prev, sched, target)
    state, done = speculate_update(ec, prev, sched, verified, blocks)
    if cache.linear is not None:
        # a hybrid model's slots continue from the checkpoint of their last committed row
        # (jmtp.model.gated_deltanet: one recurrent-state checkpoint per window position)
        lin = cache.linear._replace(current=next_checkpoint(
            cache.linear.current, sched.seq_lens_this_time, done.num_tokens, sched.prefilling,
            ec.window))
        if lin.saved is not None:   # prefix caching: block-boundary states (state_checkpoints)
            lin = capture_boundary_states(
                lin, prev.seq_lens_decoder, sched.seq_lens_this_time,
                jnp.where(sched.prefilling, sched.seq_lens_this_time, done.num_tokens),
                sched.prefilling, done.finished, ec.block_size)
        cache = cache._replace(linear=lin)
    budget = done.draft_budget
    if draft_limit is not None:
        budget = jnp.minimum(budget, jnp.maximum(draft_limit, 0))
    drafts, draft_probs, mtp_cache = propose(spec, model, state, prev.seq_lens_decoder, target,
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
                     top_logprob_ids=verified.top_logprob_ids, top_logprobs=verified.top_logprobs,
                     draft_tokens=state.draft_tokens[:, 1:])
    if plp is not None:
        out = dataclasses.replace(out, prompt_logprobs=plp.token, prompt_top_ids=plp.top_ids,
                                  prompt_top_logprobs=plp.top, prompt_row_start=plp.row_start)
    return state, Caches(cache, mtp_cache), out
