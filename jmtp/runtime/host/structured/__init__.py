"""Structured outputs: JSON schema, regex, choice and grammar constraints, enforced per draft
position inside the one-graph speculative step.

* :mod:`~jmtp.runtime.host.structured.params`: :class:`StructuredOutputsParams`, the user-facing
  constraint (vLLM's names) and its validation.
* :mod:`~jmtp.runtime.host.structured.grammar`: the host's grammar state (llguidance): compiling, the
  bitmask of every verify-window row, draft repair and jump-forward, roll-back.
* :mod:`~jmtp.runtime.device.bitmask`: applying a ``i32[..., ceil(V/32)]`` bitmask to logits
  inside the jitted step.
* :mod:`~jmtp.runtime.host.structured.manager`: the engine's per-step wiring (one bitmask and draft
  override per slot, committed tokens, dead ends).
"""
from jmtp.runtime.host.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
