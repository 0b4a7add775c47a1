"""Process-wide helpers under both sides: JAX's compilation cache and ahead-of-time compiles, the
memory-map budget, malloc tuning, process settings, ``jax.distributed`` start-up and multi-process
host transfers. Imports nothing else of ``jmtp.runtime``."""
