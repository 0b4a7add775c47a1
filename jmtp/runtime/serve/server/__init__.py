"""``jmtp serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`AsyncLLMEngine`.

Endpoints (OpenAI API reference, https://platform.openai.com/docs/api-reference):

* ``POST /v1/completions`` -- ``prompt`` (a string, a token-id list, or a list of either);
* ``POST /v1/chat/completions`` -- ``messages`` rendered with the model's chat template;
* both stream with ``"stream": true`` as server-sent events (``data: {json}\\n\\n`` chunks, then
  ``data: [DONE]\\n\\n``); ``stream_options.include_usage`` adds a final usage chunk;
* output constraints: ``response_format`` (``json_object``, ``json_schema``), vLLM's
  ``structured_outputs`` / ``guided_*``, and chat ``tools`` with ``tool_choice`` ``"required"`` or
  a named function (the response carries ``tool_calls``);
* ``GET /v1/models``, ``GET /health`` (JSON; 503 once the engine thread stopped or while it is
  stuck in one pass), ``GET /metrics`` (Prometheus text format, see :class:`ServerMetrics`),
  ``GET /openapi.json`` (generated from the request and response models, with their ranges).

Every error is a JSON body in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``,
answered without dropping the connection: a malformed body, an unknown field or role, a value of
the wrong type or out of range is HTTP 400 ``invalid_request_error`` naming the field (strict
pydantic models narrowed to the server's limits, then ``SamplingParams`` and
``LLMEngine.add_request``); an unknown ``model`` is 404; a body over the size limit 413; any other
failure a 500 for that request only. Nothing is queued before every field is checked; prompts are
tokenized and constraints compiled off the event loop. A client that disconnects has its requests
aborted, so their KV blocks are freed at the engine's next pass.

Modules, one job each:

* :mod:`~jmtp.runtime.serve.server.protocol` -- the OpenAI wire format: request bodies (strict
  pydantic models), error bodies, finish reasons, server-sent events, usage;
* :mod:`~jmtp.runtime.serve.server.intake` -- :class:`ServerOptions`, the per-server request models and
  the body parser (UTF-8, JSON depth, surrogates, unknown fields);
* :mod:`~jmtp.runtime.serve.server.errors` -- the one error path: the body-size middleware and the
  route class that answers every exception;
* :mod:`~jmtp.runtime.serve.server.responses` -- response bodies as models (the OpenAPI document);
* :mod:`~jmtp.runtime.serve.server.serving` -- :class:`OpenAIServing`: requests to
  ``SamplingParams`` and engine calls, engine outputs to responses and streams;
* :mod:`~jmtp.runtime.serve.server.structured` -- the output constraint (``response_format``,
  ``structured_outputs``, ``guided_*``, forced tool calls) as one ``StructuredOutputsParams``;
* :mod:`~jmtp.runtime.serve.server.tools` -- chat ``tools`` / ``tool_choice``: the forced call's JSON
  schema, the response's ``tool_calls``;
* :mod:`~jmtp.runtime.serve.server.metrics` -- :class:`ServerMetrics` (Prometheus);
* :mod:`~jmtp.runtime.serve.server.app` -- the FastAPI app (:func:`build_app`) and :func:`serve`.
"""
from __future__ import annotations

try:  # the `serve` extra
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("jmtp serve needs the `serve` extra: pip install 'jmtp[serve]'") from e

from jmtp.runtime.serve.server.app import build_app, serve
from jmtp.runtime.serve.server.intake import ServerOptions
from jmtp.runtime.serve.server.metrics import ServerMetrics
from jmtp.runtime.serve.server.protocol import (BadRequest, ChatCompletionRequest, ChatMessage,
                                                CompletionRequest, StreamOptions, TextPart,
                                                error_body, param_of)
from jmtp.runtime.serve.server.serving import OpenAIServing

__all__ = ["BadRequest", "ChatCompletionRequest", "ChatMessage", "CompletionRequest",
           "OpenAIServing", "ServerMetrics", "ServerOptions", "StreamOptions", "TextPart",
           "build_app", "error_body", "param_of", "serve"]
