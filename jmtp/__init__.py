"""jmtp: multi-token-prediction (MTP) speculative decoding for LLM serving in JAX.

Public API::

    import jmtp
    llm = jmtp.LLM(speculative_config=jmtp.SpeculativeConfig("mtp", num_speculative_tokens=3))
    outs = llm.generate(["Hello"], jmtp.SamplingParams(max_tokens=32))

On the CPU, importing jmtp first sets glibc's malloc to keep XLA's per-step scratch memory mapped
between steps (:mod:`jmtp.runtime.host_malloc`; ``JMTP_MALLOC_TUNING=0`` opts out).
"""
import warnings as _warnings

from jmtp.runtime import host_malloc as _host_malloc

try:
    _host_malloc.configure()   # before any XLA thread exists: see the module docstring
except ValueError as _e:        # a mistyped JMTP_MALLOC_TUNING must not make jmtp unimportable
    _warnings.warn(f"{_e}; malloc settings left alone", stacklevel=2)

from jmtp.core.errors import InvalidRequestError  # noqa: E402
from jmtp.runtime.config import EngineConfig, SpeculativeConfig  # noqa: E402
from jmtp.runtime.engine import LLM  # noqa: E402
from jmtp.runtime.handoff import RequestState  # noqa: E402
from jmtp.runtime.host_maps import MapLimitError  # noqa: E402
from jmtp.runtime.llm_engine import LLMEngine  # noqa: E402
from jmtp.runtime.outputs import CompletionOutput, RequestOutput, SpecDecodeMetrics  # noqa: E402
from jmtp.runtime.sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "SpeculativeConfig", "EngineConfig",
           "RequestOutput", "CompletionOutput", "SpecDecodeMetrics", "RequestState",
           "MapLimitError", "InvalidRequestError"]
