"""``jmtp serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`AsyncLLMEngine`.

Endpoints (OpenAI API reference, https://platform.openai.com/docs/api-reference):

* ``POST /v1/completions`` -- ``prompt`` (a string, a token-id list, or a list of either);
* ``POST /v1/chat/completions`` -- ``messages`` rendered with the model's chat template;
* both stream with ``"stream": true`` as server-sent events (``data: {json}\\n\\n`` chunks, then
  ``data: [DONE]\\n\\n``); ``stream_options.include_usage`` adds a final usage chunk;
* output constraints: ``response_format`` (``json_object``, ``json_schema``), vLLM's
  ``structured_outputs`` / ``guided_*``, and chat ``tools`` with ``tool_choice`` ``"required"`` or
  a named function (the response carries ``tool_calls``);
* ``GET /v1/models``, ``GET /health`` (503 once the engine thread stopped), ``GET /metrics``
  (Prometheus text format, see :class:`ServerMetrics`).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: a malformed or
out-of-range field is HTTP 400 ``invalid_request_error`` naming the field (pydantic validates types,
``SamplingParams`` and ``LLMEngine.add_request`` validate values); an unknown ``model`` is 404; any
other failure is a 500 for that request only. A client that disconnects has its requests aborted, so
their KV blocks are freed at the engine's next pass.

Modules, one job each:

* :mod:`~jmtp.runtime.server.protocol` -- the OpenAI wire format: request bodies (pydantic),
  error bodies, finish reasons, server-sent events, usage;
* :mod:`~jmtp.runtime.server.serving` -- :class:`OpenAIServing`: requests to
  ``SamplingParams`` and engine calls, engine outputs to responses and streams;
* :mod:`~jmtp.runtime.server.structured` -- the output constraint (``response_format``,
  ``structured_outputs``, ``guided_*``, forced tool calls) as one ``StructuredOutputsParams``;
* :mod:`~jmtp.runtime.server.tools` -- chat ``tools`` / ``tool_choice``: the forced call's JSON
  schema, the response's ``tool_calls``;
* :mod:`~jmtp.runtime.server.metrics` -- :class:`ServerMetrics` (Prometheus);
* :mod:`~jmtp.runtime.server.app` -- the FastAPI app (:func:`build_app`) and :func:`serve`.
"""
from __future__ import annotations

try:  # the `serve` extra
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("jmtp serve needs the `serve` extra: pip install 'jmtp[serve]'") from e

from jmtp.runtime.server.app import build_app, serve
from jmtp.runtime.server.metrics import ServerMetrics
from jmtp.runtime.server.protocol import (BadRequest, ChatCompletionRequest, ChatMessage,
                                          CompletionRequest, StreamOptions, TextPart, error_body,
                                          param_of)
from jmtp.runtime.server.serving import OpenAIServing

__all__ = ["BadRequest", "ChatCompletionRequest", "ChatMessage", "CompletionRequest",
           "OpenAIServing", "ServerMetrics", "StreamOptions", "TextPart", "build_app",
           "error_body", "param_of", "serve"]
