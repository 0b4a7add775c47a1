"""The FastAPI app of ``jmtp serve`` (:func:`build_app`: routes, error handlers, the engine's
lifespan) and :func:`serve` (uvicorn)."""
from __future__ import annotations

import contextlib
import logging

import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from jmtp.runtime.async_engine import AsyncLLMEngine, EngineDeadError
from jmtp.runtime.server.metrics import ServerMetrics
from jmtp.runtime.server.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest,
                                          error_body)
from jmtp.runtime.server.serving import OpenAIServing

log = logging.getLogger("jmtp.runtime.server")   # the server's one logger name


def build_app(engine: AsyncLLMEngine, tokenizer, *, model_name: str, max_model_len: int,
              metrics: ServerMetrics, max_logprobs: int = 0) -> FastAPI:
    """The FastAPI app. ``engine`` is shut down when the app's lifespan ends; ``metrics`` should be
    the engine's ``on_step`` observer."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="jmtp", lifespan=lifespan)
    serving = OpenAIServing(engine, tokenizer, model_name, max_model_len, metrics, max_logprobs)

    def err(status: int, message: str, type_: str, param, code=None) -> JSONResponse:
        metrics.request_errors.labels(status=str(status)).inc()
        return JSONResponse(error_body(message, type_, param, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, exc: RequestValidationError):
        e = exc.errors()[0] if exc.errors() else {}
        if e.get("type") == "json_invalid":
            return err(400, f"request body is not valid JSON: {e.get('ctx', {}).get('error', '')}",
                       "invalid_request_error", None)
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc)
        return err(400, f"{where}: {e.get('msg', 'invalid request')}" if where else
                   e.get("msg", "invalid request"), "invalid_request_error", param)

    @app.exception_handler(BadRequest)
    async def on_bad_request(request, exc: BadRequest):
        return err(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(EngineDeadError)
    async def on_dead(request, exc: EngineDeadError):
        return err(503, str(exc), "service_unavailable", None)

    @app.exception_handler(Exception)
    async def on_error(request, exc: Exception):
        log.exception("request failed")
        return err(500, f"{type(exc).__name__}: {exc}", "internal_error", None)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        metrics.requests.labels(endpoint="completions").inc()
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        metrics.requests.labels(endpoint="chat").inc()
        return await serving.chat(req, raw)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "jmtp", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        if engine.is_dead or not engine.is_running:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        # Gauges are refreshed by the engine thread after every step / command pass.
        return Response(metrics.render(), media_type=prom.CONTENT_TYPE_LATEST)

    return app


def serve(llm, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", engine=None) -> int:
    """Serve ``llm`` (a :class:`jmtp.LLM`, built by the caller: ``jmtp serve`` builds it from its
    options) over the OpenAI-compatible API as ``model_name``, with uvicorn, until interrupted.
    ``engine``: what the engine thread calls instead of ``llm.llm_engine`` (on a multi-process
    mesh, a :class:`~jmtp.runtime.mirror.MirroredEngine`)."""
    import uvicorn

    metrics = ServerMetrics()
    engine = AsyncLLMEngine(engine if engine is not None else llm.llm_engine,
                            on_step=metrics.on_step, start=False)
    app = build_app(engine, llm.tokenizer, model_name=model_name,
                    max_model_len=llm.engine_config.max_model_len, metrics=metrics,
                    max_logprobs=llm.llm_engine.engine_config.max_logprobs)
    log.info("serving %s on http://%s:%d", model_name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
    return 0
