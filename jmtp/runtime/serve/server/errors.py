"""One error path for ``jmtp serve``: every error is answered as a JSON body in OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``) by code that keeps the client's keep-alive
connection usable.

* :class:`BodyLimit` (ASGI middleware): a request body larger than the server's limit is refused
  with 413 before it is read (from ``Content-Length``), or as soon as a body without one passes
  the limit (:class:`BodyTooLarge`, answered by the route).
* :func:`error_route`: an ``APIRoute`` class whose handler answers every exception itself
  (:class:`BadRequest` → its status, ``EngineDeadError`` → 503, anything else → 500 with the
  traceback in the server log only). An exception that reached Starlette's
  ``ServerErrorMiddleware`` instead would be re-raised after its 500, and uvicorn then drops the
  connection: the client's next request on it fails with a read error.
"""
from __future__ import annotations

import logging
from typing import Callable

from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.datastructures import Headers

from jmtp.runtime.serve.async_engine import EngineDeadError
from jmtp.runtime.serve.server.protocol import BadRequest, error_body

log = logging.getLogger("jmtp.runtime.serve.server")

#: ``(status, message, type, param, code, path)`` -> the error response (counts it in metrics).
ErrorResponder = Callable[..., JSONResponse]


class BodyTooLarge(BadRequest):
    """A request body without ``Content-Length`` passed the server's limit while being read."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than this server's limit of {limit} bytes",
                         None, status=413, code="request_too_large")


class BodyLimit:
    """ASGI middleware: request bodies of at most ``limit`` bytes.

    Args:
      app: the ASGI app. limit: bytes.
      refuse: ``(scope, error) -> None`` called for a body refused from its ``Content-Length``
        (metrics), before the 413 is sent.
    """

    def __init__(self, app, limit: int, refuse: Callable | None = None):
        self.app, self.limit, self.refuse = app, int(limit), refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        try:
            length = int(length) if length is not None else None
        except ValueError:
            length = None
        if length is not None and length > self.limit:
            err = BodyTooLarge(self.limit)
            if self.refuse is not None:
                self.refuse(scope, err)
            # Not read: the connection cannot carry another request after this one.
            response = JSONResponse(error_body(err.message, err.type, err.param, err.code),
                                    status_code=413, headers={"Connection": "close"})
            return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited_receive, send)


def error_route(respond: ErrorResponder) -> type[APIRoute]:
    """An ``APIRoute`` subclass whose handler turns every exception into ``respond(...)``."""

    class ErrorAnsweringRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()
            path = self.path

            async def answer(request):
                try:
                    return await handler(request)
                except BadRequest as e:
                    headers = {"Connection": "close"} if isinstance(e, BodyTooLarge) else None
                    return respond(e.status, e.message, e.type, e.param, e.code, path,
                                   headers=headers)
                except EngineDeadError as e:
                    return respond(503, str(e), "service_unavailable", None, "engine_dead", path)
                except Exception:  # noqa: BLE001 -- answered here: the connection stays usable
                    log.exception("request to %s failed", path)
                    return respond(500, "internal server error (the server log has the details)",
                                   "internal_error", None, None, path)

            return answer

    return ErrorAnsweringRoute
