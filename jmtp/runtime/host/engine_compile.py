"""The engine's compile and memory calls (a mixin of :class:`~jmtp.runtime.host.llm_engine.LLMEngine`):
which step buckets are compiled, compiling them ahead of use, the bucket a step runs in, device
memory, and timing the decode buckets for the dynamic speculation policy."""
from __future__ import annotations

from typing import Iterable

from jmtp.runtime.device.buckets import StepBucket
from jmtp.runtime.host.scheduler import reuse_bucket


class CompileAPI:
    """Mixed into ``LLMEngine``; reads its ``runner``, ``compile_mode``, ``spec_policy`` and
    ``scheduler``."""

    @property
    def compiled_buckets(self) -> frozenset[StepBucket]:
        """The step buckets compiled so far (ahead of time or by a first run)."""
        return self.runner.compiled_buckets

    def uncompiled_buckets(self) -> tuple[StepBucket, ...]:
        """The step buckets (:func:`~jmtp.runtime.device.buckets.step_buckets`) not compiled yet."""
        return self.runner.uncompiled_buckets()

    def bucket_to_run(self, bucket: StepBucket) -> StepBucket:
        """The bucket a step sized as ``bucket`` runs in: with lazy compiles and no dynamic
        policy (which prices and times each bucket it plans for), an already compiled bucket
        that holds it at most twice over (:func:`~jmtp.runtime.host.scheduler.reuse_bucket`);
        with ``compile="fewest"``, any compiled bucket that holds it; with ``compile="largest"``,
        the largest bucket of :func:`~jmtp.runtime.device.buckets.step_buckets` (it holds every
        step the scheduler plans)."""
        if self.compile_mode == "eager" or self.spec_policy is not None:
            return bucket
        if self.compile_mode == "largest":
            return self.runner.largest_bucket
        return reuse_bucket(bucket, self.runner.compiled_buckets,
                            float("inf") if self.compile_mode == "fewest" else 2.0)

    def compile_buckets(self, buckets: Iterable[StepBucket] | None = None, *,
                        progress: bool = False) -> dict[str, float]:
        """Compile step buckets (default: every uncompiled one of
        :func:`~jmtp.runtime.device.buckets.step_buckets`) ahead of their first use; nothing runs. A
        lazy engine warms up so in idle time (``jmtp chat`` does while the user types). Returns
        ``{bucket label: seconds}``; raises ``MapLimitError`` before a compile that would cross
        the process's memory-map limit. ``progress``: a tqdm bar."""
        return self.runner.compile_buckets(buckets, progress=progress)

    def memory_per_device(self) -> dict:
        """``{"params": (per device, total), "kv_cache": (per device, total)}`` bytes."""
        return self.runner.memory_per_device()

    def param_bytes(self) -> dict[str, int]:
        """Device bytes of the parameters, 8-bit values, their scales and the rest apart
        (:meth:`DeviceRunner.param_bytes <jmtp.runtime.device.runner.DeviceRunner.param_bytes>`)."""
        return self.runner.param_bytes()

    def kv_cache_bytes(self) -> dict[str, int]:
        """Device bytes of the KV caches, values and scales apart
        (:meth:`DeviceRunner.kv_cache_bytes <jmtp.runtime.device.runner.DeviceRunner.kv_cache_bytes>`)."""
        return self.runner.kv_cache_bytes()

    def calibrate_speculation(self, repeats: int = 3) -> dict[StepBucket, float]:
        """Time every decode step bucket on the idle engine (fastest of ``repeats`` runs after
        one untimed) and seed the dynamic speculation policy's cost table with the times
        (:meth:`DynamicSpeculation.seed_costs`; with suffix decoding, the table its draft cuts
        are priced by); returns them, ``{StepBucket: seconds}``. Called
        by the constructor with ``speculation_policy="dynamic"`` and ``compile="eager"``. An idle
        step changes no cache or request state; the policy rescales the seeds by what it
        measures live (``docs/architecture.md``).

        Raises:
          ValueError: no dynamic policy, or ``repeats < 1``.
          RuntimeError: requests are in the engine.
        """
        costs = (self.spec_policy.costs if self.spec_policy is not None else
                 getattr(self.suffix, "costs", None))
        if costs is None:
            raise ValueError("calibrate_speculation needs SpeculativeConfig(speculation_policy="
                             "'dynamic')")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        if self.has_unfinished_requests() or self.scheduler.num_running:
            raise RuntimeError("calibrate_speculation runs on an idle engine only")
        seconds = self.runner.time_decode_buckets(repeats)
        costs.seed(seconds)
        return seconds


__all__ = ["CompileAPI"]
