"""The host serving loop, NumPy only: ``LLM``, ``LLMEngine``, ``EngineArgs``, the scheduler and
request table, sampling parameters and rows, prefix caching, the hand-off wire format, the dynamic
speculation policy and structured-output matchers. Reaches the device only through
:mod:`jmtp.runtime.device.runner` and the step's public types (``tests/test_layering.py``)."""
