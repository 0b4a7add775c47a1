"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``) from the target's prefill rows.

A prefill chunk's hidden rows are in the step already (:func:`~jmtp.runtime.device.target_stages.
target_forward`); the window logits take only a chunk's last row. When a prefilling slot asks for
prompt logprobs, :func:`prompt_logprobs` runs the LM head over every packed row of the step and
returns, per row, the logprob of the context token that follows the row (the prompt token it
predicts) and the row's top-``n`` logprobs, ``n = EngineConfig.max_logprobs``. The logprobs are
the model's own (log-softmax of the raw logits: no ``logit_bias``, penalty or temperature; vLLM's
``raw_logprobs``). The host keeps the rows of the slots that asked, for prompt positions only
(:meth:`~jmtp.runtime.host.requests.RequestTable.record_prompt_logprobs`). Skipped at run time
(``lax.cond``) when no prefilling slot asks: the step then costs what it did; compiled only into
engines with ``max_logprobs > 0``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jmtp.model.metadata import packed_row_seq
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.sharding import uniform_any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Per packed row of one step (``T`` = the bucket's token rows).

    Attributes:
      token: f32[T] logprob of the context token after the row (0 where nothing asked).
      top_ids: i32[T, n] ids of the row's n most likely tokens (ties: lower id first).
      top: f32[T, n] their logprobs.
      row_start: i32[B] first packed row of each slot (``cu_q_lens[:B]``).
    """

    token: jax.Array
    top_ids: jax.Array
    top: jax.Array
    row_start: jax.Array


def prompt_logprobs(ec: EngineConfig, model, state, sched, target) -> PromptLogprobs | None:
    """The step's :class:`PromptLogprobs` (None when ``ec.max_logprobs == 0``).

    Args:
      ec: the engine config (``max_logprobs`` = n, static).
      model: the target (:meth:`~jmtp.model.modules.LlamaForCausalLM.target_logits`).
      state: the state the step started from (``input_ids`` holds every context token;
        ``seq_lens_decoder`` the position of each slot's first row; ``sampling.prompt_logprobs``
        which slots ask).
      sched: the step's :class:`~jmtp.runtime.device.target_stages.Schedule` (``prefilling``).
      target: the step's :class:`~jmtp.runtime.device.target_stages.TargetOutput` (``hidden``,
        ``cu_q_lens``).
    """
    n = ec.max_logprobs
    if n == 0:
        return None
    B = ec.max_num_seqs
    hidden, cu = target.hidden, target.cu_q_lens
    T = hidden.shape[0]
    seq, local = packed_row_seq(cu, T)
    nxt = state.input_ids[seq, jnp.clip(state.seq_lens_decoder[seq] + local + 1, 0,
                                        ec.seq_buffer_len - 1)]
    asked = sched.prefilling & (state.sampling.prompt_logprobs >= 0)

    def compute(h):
        lp = jax.nn.log_softmax(model.target_logits(h).astype(jnp.float32), axis=-1)
        token = jnp.take_along_axis(lp, jnp.clip(nxt, 0, lp.shape[-1] - 1)[:, None], axis=-1)
        top, ids = jax.lax.top_k(lp, n)
        return token[:, 0], ids.astype(jnp.int32), top

    def skip(h):
        return (jnp.zeros((T,), jnp.float32), jnp.zeros((T, n), jnp.int32),
                jnp.zeros((T, n), jnp.float32))

    token, ids, top = jax.lax.cond(uniform_any(asked), compute, skip, hidden)
    return PromptLogprobs(token=token, top_ids=ids, top=top, row_start=cu[:B].astype(jnp.int32))


__all__ = ["PromptLogprobs", "prompt_logprobs"]
