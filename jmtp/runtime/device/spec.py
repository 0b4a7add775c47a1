"""The engine step's static bundle and its two array pytrees.

:func:`~jmtp.runtime.device.step.engine_step` is ``engine_step(spec, model_state, state, caches,
inputs)``: one static argument and four pytrees of arrays, passed by name (jitted with
``static_argnames=("spec",)``, ``donate_argnames=("state", "caches")``).

* :class:`StepSpec` (static, frozen, hashable; one compiled program per distinct spec): the
  model's ``nnx.GraphDef``, one data shard's :class:`~jmtp.runtime.config.EngineConfig`, the
  :class:`~jmtp.runtime.device.buckets.StepBucket` ``(T, A)`` and the resolved
  :class:`~jmtp.pallas.ragged_paged_attention.AttentionBackend`. The drafter is read from the
  engine config (:attr:`StepSpec.drafter`), never passed on its own; the attention backend is
  resolved once, by whoever builds the spec (:meth:`StepSpec.build`), not inside the trace.
* :class:`Caches`: the target's KV cache and the MTP head's (None without one).
* :class:`StepInputs`: the per-step host inputs (``prefill_chunk``, ``draft_limit``,
  ``token_bitmask``, ``draft_override``).

Every place that calls the step builds its arguments with
:meth:`jmtp.runtime.device.runner.DeviceRunner.step_args`.
"""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jmtp.model.llama import KVCache
from jmtp.pallas.ragged_paged_attention import AttentionBackend, resolve_backend
from jmtp.runtime.config import EngineConfig
from jmtp.runtime.device.buckets import StepBucket


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The static part of one engine step (hashable: the jit cache key).

    Attributes:
      graphdef: the model's ``nnx.GraphDef`` (``nnx.split``; its ``ModelConfig`` included).
      engine: one data shard's :class:`EngineConfig` (the engine's own without data parallelism).
      bucket: the :class:`StepBucket` ``(T, A)`` the host picked
        (:func:`~jmtp.runtime.device.buckets.choose_bucket`): T token rows, at least
        ``sum(seq_lens_this_time)``, and A slot rows, at least the number of slots with work.
      attention: the resolved :class:`AttentionBackend` (its platform decides the kernels'
        interpret mode, not the host's).

    Raises:
      ValueError: ``bucket.num_slots`` outside ``[1, engine.max_num_seqs]``; ``attention`` not
        resolved (use :meth:`build`).
    """

    graphdef: nnx.GraphDef
    engine: EngineConfig
    bucket: StepBucket
    attention: AttentionBackend

    def __post_init__(self):
        B = self.engine.max_num_seqs
        if not isinstance(self.bucket, StepBucket):
            raise ValueError(f"StepSpec.bucket must be a StepBucket, got {self.bucket!r}")
        if not 1 <= self.bucket.num_slots <= B:
            raise ValueError(f"StepBucket.num_slots={self.bucket.num_slots} must lie in "
                             f"[1, max_num_seqs={B}]")
        if not isinstance(self.attention, AttentionBackend):
            raise ValueError(f"StepSpec.attention must be a resolved AttentionBackend "
                             f"(StepSpec.build resolves it), got {self.attention!r}")

    @classmethod
    def build(cls, graphdef: nnx.GraphDef, engine: EngineConfig, bucket: StepBucket | int,
              attention: AttentionBackend | str | None = None) -> "StepSpec":
        """A spec with ``bucket`` as a :class:`StepBucket` (an int ``T`` means
        ``A = max_num_seqs``) and ``attention`` resolved for ``engine.platform`` (a name, or
        None: the platform's best)."""
        if not isinstance(bucket, StepBucket):
            bucket = StepBucket(int(bucket), engine.max_num_seqs)
        if not isinstance(attention, AttentionBackend):
            attention = resolve_backend(attention, engine.platform)
        return cls(graphdef, engine, bucket, attention)

    @property
    def drafter(self):
        """The custom drafter (``SpeculativeConfig.drafter``: ``callable(state) -> i32[B, K]``),
        or None (MTP head, n-gram, no speculation)."""
        return self.engine.spec.drafter

    def with_bucket(self, bucket: StepBucket) -> "StepSpec":
        return dataclasses.replace(self, bucket=bucket)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Caches:
    """The step's KV caches (donated, returned updated).

    Attributes:
      target: the target's :class:`~jmtp.model.llama.KVCache` (``L`` layers; a hybrid model's
        recurrent state pool in ``target.linear``).
      mtp: the MTP head's cache (``num_mtp_layers``), None without an MTP head.
    """

    target: KVCache
    mtp: KVCache | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The host's per-step inputs (data: new values never recompile). ``B`` = the shard's slots.

    Attributes:
      prefill_chunk: i32[B] prompt tokens each prefilling slot processes this step (clipped to
        what is left of its prompt; ignored for decoding and idle slots).
      draft_limit: i32[B] or None: at most this many drafts are proposed per slot for the next
        step (the dynamic speculation policy, :mod:`jmtp.runtime.host.spec_policy`). None = K.
      token_bitmask: i32[B, K+1, ceil(V/32)] or None: the structured-output constraint of every
        verify-window row (:mod:`jmtp.runtime.device.bitmask`); all ones or None constrains
        nothing.
      draft_override: i32[B, K] or None: the host's repair of this step's windows (forced tokens
        with one-hot q, cut windows; :func:`~jmtp.runtime.device.bitmask.override_drafts`).
    """

    prefill_chunk: jax.Array
    draft_limit: jax.Array | None = None
    token_bitmask: jax.Array | None = None
    draft_override: jax.Array | None = None


__all__ = ["Caches", "StepInputs", "StepSpec"]
