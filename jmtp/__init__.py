"""jmtp: multi-token-prediction (MTP) speculative decoding for LLM serving in JAX.

Public API::

    import jmtp
    llm = jmtp.LLM(speculative_config=jmtp.SpeculativeConfig("mtp", num_speculative_tokens=3))
    outs = llm.generate(["Hello"], jmtp.SamplingParams(max_tokens=32))

    # constrained to a JSON schema (also regex, choice, grammar), inside the speculative step
    sp = jmtp.SamplingParams(max_tokens=64, structured_outputs=jmtp.StructuredOutputsParams(
        json={"type": "object", "properties": {"ok": {"type": "boolean"}}}))

    # compile for a TPU slice on any machine (libtpu's compiler) and read per-device HBM
    report = jmtp.compile_engine(jmtp.EngineArgs(model_config=cfg, tensor_parallel_size=4),
                                 topology="v5e:2x2")

``import jmtp`` changes nothing process-wide; what building an engine or the command line changes
(malloc settings on the CPU, JAX's compilation cache) is listed in :mod:`jmtp.runtime.process.settings`.
"""
from jmtp.aot import AotReport, compile_engine
from jmtp.core.errors import InvalidRequestError, RequestFailedError
from jmtp.runtime.config import EngineConfig, SpeculativeConfig
from jmtp.runtime.host.engine_args import EngineArgs
from jmtp.runtime.host.handoff import RequestState
from jmtp.runtime.host.llm import LLM
from jmtp.runtime.host.llm_engine import LLMEngine
from jmtp.runtime.host.outputs import CompletionOutput, RequestOutput, SpecDecodeMetrics
from jmtp.runtime.host.sampling_params import SamplingParams
from jmtp.runtime.host.structured import StructuredOutputsParams
from jmtp.runtime.process.host_maps import MapLimitError

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "SpeculativeConfig", "EngineConfig",
           "RequestOutput", "CompletionOutput", "SpecDecodeMetrics", "RequestState",
           "MapLimitError", "InvalidRequestError", "RequestFailedError", "EngineArgs",
           "compile_engine", "AotReport", "StructuredOutputsParams"]
