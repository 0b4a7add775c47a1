"""The FastAPI app of ``jmtp serve`` (:func:`build_app`: routes, the error path, the OpenAPI
document, the engine's lifespan) and :func:`serve` (uvicorn).

Generation requests read their body themselves (:func:`~jmtp.runtime.serve.server.intake.parse_request`:
size-bounded, strict JSON, strict models), so every failure is answered in OpenAI's error shape by
the route (:mod:`~jmtp.runtime.serve.server.errors`) and no FastAPI default (``{"detail": ...}``,
HTTP 422) is ever sent. The OpenAPI document describes the request bodies with this server's
models (their ranges), every response with its model, and the error statuses the routes answer.
"""
import contextlib
import logging

import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from jmtp.runtime.serve.async_engine import AsyncLLMEngine
from jmtp.runtime.serve.server.errors import BodyLimit, error_route
from jmtp.runtime.serve.server.intake import (IGNORED_FIELDS_HEADER, ServerOptions, parse_request,
                                              request_models)
from jmtp.runtime.serve.server.metrics import ServerMetrics
from jmtp.runtime.serve.server.protocol import error_body
from jmtp.runtime.serve.server.responses import (GENERATION_ERRORS, STREAM_MODELS,
                                                 ChatCompletionResponse, CompletionResponse,
                                                 ErrorResponse, Health, ModelList, event_stream_doc)
from jmtp.runtime.serve.server.serving import OpenAIServing

log = logging.getLogger("jmtp.runtime.serve.server")   # the server's one logger name
#: Generation endpoints: path -> the ``endpoint`` label of the request metrics.
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _body_doc(name: str) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def build_app(engine: AsyncLLMEngine, tokenizer, *, model_name: str, max_model_len: int,
              metrics: ServerMetrics, max_logprobs: int = 0, vocab_size: int | None = None,
              max_stop_ids: int = 8, options: ServerOptions | None = None) -> FastAPI:
    """The FastAPI app. ``engine`` is shut down when the app's lifespan ends; ``metrics`` should be
    the engine's ``on_step`` observer. ``vocab_size`` (default: the tokenizer's) bounds token ids;
    ``max_stop_ids`` is the engine's ``EngineConfig.max_stop_ids``."""
    options = options or ServerOptions()
    vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
    models = request_models(options, max_model_len=max_model_len, vocab_size=vocab_size,
                            max_logprobs=max_logprobs, max_stop_ids=max_stop_ids)
    serving = OpenAIServing(engine, tokenizer, model_name, max_model_len, metrics, max_logprobs,
                            options)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        metrics.watch_gc()          # first: the engine thread's collections are timed too
        engine.start()
        try:
            yield
        finally:
            metrics.unwatch_gc()
            engine.shutdown()
            serving.close()

    def respond(status: int, message: str, type_: str, param, code=None, path: str = "",
                headers: dict | None = None) -> JSONResponse:
        if path != "/health":
            metrics.request_errors.labels(status=str(status)).inc()
        if path in ENDPOINTS and 400 <= status < 500:
            metrics.rejected.labels(endpoint=ENDPOINTS[path]).inc()
        return JSONResponse(error_body(message, type_, param, code), status_code=status,
                            headers=headers)

    def refused(scope, err) -> None:   # a body refused from its Content-Length (BodyLimit)
        path = scope.get("path", "")
        if path in ENDPOINTS:
            metrics.requests.labels(endpoint=ENDPOINTS[path]).inc()
            metrics.rejected.labels(endpoint=ENDPOINTS[path]).inc()
        metrics.request_errors.labels(status="413").inc()

    app = FastAPI(title="jmtp", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions served by jmtp "
                              "(MTP speculative decoding in JAX). Every error body has OpenAI's "
                              "shape, ErrorResponse.")
    app.router.route_class = error_route(respond)
    app.add_middleware(BodyLimit, limit=options.max_request_bytes, refuse=refused)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc: StarletteHTTPException):
        # The router's own answers (unknown path 404, wrong method 405), in OpenAI's shape.
        r = respond(exc.status_code, str(exc.detail), "invalid_request_error", None, None,
                    request.url.path)
        for k, v in (exc.headers or {}).items():
            r.headers[k] = v
        return r

    async def generate(raw: Request, endpoint: str, run):
        metrics.requests.labels(endpoint=endpoint).inc()
        req, ignored = parse_request(await raw.body(), models[endpoint],
                                     ignore_unknown_fields=options.ignore_unknown_fields)
        response = await run(req, raw)
        if ignored:
            response.headers[IGNORED_FIELDS_HEADER] = ", ".join(ignored)
        return response

    @app.post("/v1/completions", response_model=CompletionResponse, responses={
        200: {"content": event_stream_doc("CompletionChunk")}, **GENERATION_ERRORS},
        openapi_extra=_body_doc("CompletionRequest"))
    async def completions(raw: Request):
        """Text completions (OpenAI ``/v1/completions``; ``stream`` sends server-sent events)."""
        return await generate(raw, "completions", serving.completions)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={
        200: {"content": event_stream_doc("ChatCompletionChunk")}, **GENERATION_ERRORS},
        openapi_extra=_body_doc("ChatCompletionRequest"))
    async def chat_completions(raw: Request):
        """Chat completions (OpenAI ``/v1/chat/completions``; ``stream`` sends server-sent
        events)."""
        return await generate(raw, "chat", serving.chat)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models():
        """The served model."""
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "jmtp", "max_model_len": max_model_len}]}

    @app.get("/health", response_model=Health, responses={503: {
        "model": ErrorResponse, "description": "The engine thread is dead, or has been in one "
        "pass longer than the server's engine_stall_seconds"}})
    async def health():
        """200 while the engine thread serves; 503 once it stopped or while it is stuck."""
        if engine.is_dead or not engine.is_running:
            return respond(503, "the engine thread is not running", "service_unavailable", None,
                           "engine_dead", "/health")
        busy = engine.busy_seconds
        if busy > options.engine_stall_seconds:
            return respond(503, f"the engine thread has been in one pass for {busy:.1f} s "
                           f"(limit {options.engine_stall_seconds:g} s)", "service_unavailable",
                           None, "engine_stalled", "/health")
        return {"status": "ok", "busy_seconds": round(busy, 3),
                "requests_in_flight": int(engine.stats.get("num_requests_in_flight", 0))}

    @app.get("/metrics", response_class=Response, responses={200: {
        "content": {"text/plain": {"schema": {"type": "string"}}},
        "description": "Prometheus text format"}})
    async def prometheus_metrics():
        """Prometheus metrics (``ServerMetrics``); gauges are refreshed by the engine thread
        after every step."""
        return Response(metrics.render(), media_type=prom.CONTENT_TYPE_LATEST)

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description,
                              routes=app.routes)
            _, defs = models_json_schema(
                [(models["completions"], "validation"), (models["chat"], "validation")]
                + [(m, "serialization") for m in STREAM_MODELS],
                ref_template="#/components/schemas/{model}")
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    return app


def serve(llm, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", options: ServerOptions | None = None,
          engine=None) -> int:
    """Serve ``llm`` (a :class:`jmtp.LLM`, built by the caller: ``jmtp serve`` builds it from its
    options) over the OpenAI-compatible API as ``model_name``, with uvicorn, until interrupted.
    ``engine``: what the engine thread calls instead of ``llm.llm_engine`` (on a multi-process
    mesh, a :class:`~jmtp.runtime.host.mirror.MirroredEngine`). Before serving, the process's
    start-up heap is frozen (:func:`~jmtp.runtime.process.settings.freeze_heap`)."""
    import uvicorn

    from jmtp.runtime.process.settings import freeze_heap

    metrics = ServerMetrics()
    engine = AsyncLLMEngine(engine if engine is not None else llm.llm_engine,
                            on_step=metrics.on_step, start=False)
    ec = llm.llm_engine.engine_config
    app = build_app(engine, llm.tokenizer, model_name=model_name, max_model_len=ec.max_model_len,
                    metrics=metrics, max_logprobs=ec.max_logprobs,
                    vocab_size=llm.llm_engine.model_config.vocab_size,
                    max_stop_ids=ec.max_stop_ids, options=options)
    freeze_heap()      # the start-up heap out of the collector's full passes (settings.py)
    log.info("serving %s on http://%s:%d", model_name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
    return 0
