"""Proposers: one per ``SpeculativeConfig.method``, behind one signature, in one registry.

A proposer turns the step's target output into the next windows' drafts:
``proposer(x: ProposeInputs) -> (drafts i32[B, K], draft_probs f32[B, K, V] | None, mtp_cache)``
(-1 past a slot's drafts; each slot at most ``x.draft_budget[b]`` drafts; ``draft_probs`` only
with draft sampling, the distributions q the drafts were sampled from). It runs inside the one
jitted engine step (:func:`jmtp.runtime.device.step.engine_step`), so it must be traceable jnp code.

Registry (:data:`PROPOSERS`):

* ``"mtp"``: the MTP head, ``M`` substeps (:func:`~jmtp.runtime.device.draft_stages.draft_model_preprocess`,
  :func:`~jmtp.runtime.device.draft_stages.mtp_substep`; FastDeploy ``MTPProposer._propose``); with
  ``mtp_strategy="with_ngram"`` (FastDeploy ``hybrid_mtp_ngram``) n-gram matches extend the M MTP
  drafts up to K;
* ``"ngram"``: prompt-lookup n-gram matching (:func:`~jmtp.runtime.device.ngram.ngram_match`,
  FastDeploy ``ngram_match``);
* ``"custom"``: ``SpeculativeConfig.drafter(state) -> i32[B, K]``;
* ``"suffix"``: nothing on the device: the host's suffix drafts enter the next step through its
  ``draft_override`` input (:mod:`jmtp.runtime.host.suffix_decoding`);
* ``None``: no speculation (``K = 0``).

A new proposer is a function here and an entry in :data:`PROPOSERS` (plus the method name in
``jmtp.runtime.config.METHODS``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jmtp.model.llama import KVCache
from jmtp.model.modules import LlamaForCausalLM
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.draft_stages import draft_model_preprocess, mtp_substep
from jmtp.runtime.device.ngram import extend_with_ngram, ngram_match
from jmtp.runtime.device.sharding import uniform_any
from jmtp.runtime.device.spec import StepSpec
from jmtp.runtime.device.state import EngineState
from jmtp.runtime.device.target_stages import TargetOutput, scatter_slots


@dataclasses.dataclass(frozen=True)
class ProposeInputs:
    """What a proposer may read (a plain bundle for the Python call, not a pytree).

    Attributes:
      ec: the engine (shard) config; ``ec.k`` drafts per window, ``ec.mtp_substeps`` MTP substeps.
      drafter: the custom drafter or None.
      num_tokens: the step bucket's token rows ``T`` (static).
      attention_impl: the attention implementation (static).
      model: the merged ``LlamaForCausalLM`` (its MTP layers).
      state: the engine state after the step's update.
      prev_seq_lens_decoder: i32[B] ``seq_lens_decoder`` before the step.
      target: the step's :class:`~jmtp.runtime.device.target_stages.TargetOutput`.
      draft_budget: i32[B] drafts each slot may propose (0..K).
      mtp_cache: the MTP KV cache or None.
    """

    ec: EngineConfig
    drafter: Callable | None
    num_tokens: int
    attention_impl: str | None
    model: LlamaForCausalLM
    state: EngineState
    prev_seq_lens_decoder: jax.Array
    target: TargetOutput
    draft_budget: jax.Array
    mtp_cache: KVCache | None


def _no_drafts(x: ProposeInputs) -> jax.Array:
    return jnp.full((x.ec.max_num_seqs, x.ec.k), -1, jnp.int32)


def propose_mtp(x: ProposeInputs):
    """The MTP head's M substeps (and the n-gram extension of ``with_ngram``)."""
    ec, B, K, M = x.ec, x.ec.max_num_seqs, x.ec.k, x.ec.mtp_substeps
    ngram_min, ngram_max = ec.spec.ngram_sizes
    ctx, batch = draft_model_preprocess(x.model.cfg, ec, x.num_tokens, x.state,
                                        x.prev_seq_lens_decoder, x.target, x.draft_budget)
    picks, mtp_cache = [], x.mtp_cache
    for sub in range(M):
        pick, batch, mtp_cache = mtp_substep(ec, x.attention_impl, sub, x.model, ctx, batch,
                                             mtp_cache)
        picks.append(pick)
    A = ctx.slots.shape[0]
    drafts = jnp.stack([p.tokens for p in picks], axis=1)
    if M < K:
        drafts = jnp.concatenate([drafts, jnp.full((A, K - M), -1, jnp.int32)], axis=1)
    drafts = scatter_slots(drafts, ctx.slots, B, fill=-1)          # back to i32[B, K]
    draft_probs = None
    if ec.spec.draft_sampling:
        draft_probs = jnp.stack([p.probs for p in picks], axis=1)
        if M < K:
            draft_probs = jnp.concatenate(
                [draft_probs, jnp.zeros((A, K - M, draft_probs.shape[-1]))], axis=1)
        draft_probs = scatter_slots(draft_probs, ctx.slots, B)
    if ngram_max:   # hybrid_mtp_ngram: n-gram tokens extend the M MTP drafts up to K
        budget = x.draft_budget
        mtp_drafts = jnp.where(jnp.arange(K)[None] < budget[:, None], drafts, -1)
        new_seq_len = x.state.prompt_lens + x.state.step_idx
        drafts = jax.lax.cond(      # skipped when no slot may draft past the M MTP drafts
            uniform_any(budget > M),
            lambda: extend_with_ngram(x.state.input_ids, new_seq_len, mtp_drafts, budget,
                                      ngram_max, ngram_min),
            lambda: mtp_drafts)
        if draft_probs is not None:   # n-gram drafts are deterministic: one-hot q
            from_ngram = (jnp.arange(K)[None] >= ec.mtp_substeps) & (drafts >= 0)
            one_hot = jax.nn.one_hot(jnp.maximum(drafts, 0), draft_probs.shape[-1],
                                     dtype=draft_probs.dtype)
            draft_probs = jnp.where(from_ngram[..., None], one_hot, draft_probs)
    return drafts, draft_probs, mtp_cache


def propose_ngram(x: ProposeInputs):
    """Prompt-lookup n-gram drafts (skipped at run time when no slot may draft, e.g. the dynamic
    policy chose 0 everywhere)."""
    drafts = _no_drafts(x)
    if x.ec.k == 0:
        return drafts, None, x.mtp_cache
    ngram_min, ngram_max = x.ec.spec.ngram_sizes
    new_seq_len = x.state.prompt_lens + x.state.step_idx
    drafts = jax.lax.cond(
        uniform_any(x.draft_budget > 0),
        lambda: ngram_match(x.state.input_ids, new_seq_len, x.draft_budget, ngram_max, ngram_min,
                            x.ec.k)[0],
        lambda: drafts)
    return drafts, None, x.mtp_cache


def propose_custom(x: ProposeInputs):
    """``SpeculativeConfig.drafter(state) -> i32[B, K]``."""
    if x.ec.k == 0:
        return _no_drafts(x), None, x.mtp_cache
    return x.drafter(x.state).astype(jnp.int32), None, x.mtp_cache


def propose_none(x: ProposeInputs):
    """No speculation: no drafts."""
    return _no_drafts(x), None, x.mtp_cache


#: ``SpeculativeConfig.method`` → proposer.
PROPOSERS: dict[str | None, Callable] = {
    "mtp": propose_mtp, "ngram": propose_ngram, "custom": propose_custom, "suffix": propose_none,
    None: propose_none}


def propose(spec: StepSpec, model: LlamaForCausalLM, state: EngineState,
            prev_seq_lens_decoder: jax.Array, target: TargetOutput, draft_budget: jax.Array,
            mtp_cache: KVCache | None):
    """Drafts for the next windows from the proposer of ``spec.engine.spec.method``
    (:data:`PROPOSERS`); the step's static :class:`~jmtp.runtime.device.spec.StepSpec` gives
    the shard's config, the drafter, the bucket's token rows and the attention backend.

    Returns:
      ``(drafts i32[B, K], draft_probs f32[B, K, V] | None, updated MTP cache)``.
    """
    ec = spec.engine
    x = ProposeInputs(ec, spec.drafter, spec.bucket.num_tokens, spec.attention, model, state,
                      prev_seq_lens_decoder, target, draft_budget, mtp_cache)
    method = ec.spec.method if ec.mtp_substeps > 0 or ec.spec.method != "mtp" else None
    return PROPOSERS[method](x)


__all__ = ["ProposeInputs", "PROPOSERS", "propose", "propose_mtp", "propose_ngram",
           "propose_custom", "propose_none"]
