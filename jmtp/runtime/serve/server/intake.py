"""Request intake of ``jmtp serve``: from the bytes a client sent to a validated request model,
bounded so that no body can stall the server or reach the engine with a value it cannot hold.

* :class:`ServerOptions`: the server's own limits and policies (``jmtp serve`` flags).
* :func:`request_models`: the endpoints' request models narrowed to this server's limits (``n``
  to ``max_n``, ``max_tokens`` / ``min_tokens`` below ``max_model_len``, token ids to the
  vocabulary, ``logprobs`` to ``max_logprobs``); the OpenAPI document is generated from them, so
  it states the ranges the server enforces.
* :func:`parse_request`: the body (already bounded in size by
  :class:`~jmtp.runtime.serve.server.errors.BodyLimit`) decoded as strict UTF-8, parsed as JSON (no
  ``NaN`` / ``Infinity``), nested at most :data:`MAX_JSON_DEPTH` levels, with no lone UTF-16
  surrogate in any string (valid JSON, but not Unicode text: a tokenizer cannot take it), then
  validated by the strict model. Every failure is a :class:`BadRequest` naming the field.

Unknown fields are refused by default (OpenAI does the same); with
``ServerOptions.ignore_unknown_fields`` they are logged, dropped and listed in the response's
:data:`IGNORED_FIELDS_HEADER`.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import re
from typing import Annotated, Any, Union

from pydantic import Field, ValidationError, create_model

from jmtp.core.checks import json_depth
from jmtp.runtime.host.structured.params import MAX_SCHEMA_DEPTH
from jmtp.runtime.serve.server.protocol import (BadRequest, ChatCompletionRequest,
                                                CompletionRequest, INT32_MAX)

log = logging.getLogger("jmtp.runtime.serve.server")

#: Deepest JSON nesting of a request body: a schema of MAX_SCHEMA_DEPTH levels inside
#: ``tools[i].function.parameters`` (4 levels down) fits, with room to spare.
MAX_JSON_DEPTH = MAX_SCHEMA_DEPTH + 8
#: Response header listing the fields dropped under ``ignore_unknown_fields``.
IGNORED_FIELDS_HEADER = "Jmtp-Ignored-Fields"
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Limits and policies of one server (``jmtp serve`` flags of the same names).

    Attributes:
      max_n: most samples one request may ask for: ``n``, and for a completions request with a
        list of prompts, ``len(prompt) * n`` (OpenAI's limit on ``n`` is 128).
      max_request_bytes: largest request body (bytes); a larger one is refused with HTTP 413
        before it is read (from its ``Content-Length``, else as soon as it passes the limit).
      ignore_unknown_fields: log and drop unknown request fields (listed in the response header
        ``Jmtp-Ignored-Fields``) instead of refusing the request.
      engine_stall_seconds: ``/health`` answers 503 while the engine thread has spent longer
        than this in one pass (a step and the commands around it). Raise it for servers that
        compile step buckets on first use (``--compile lazy``) of a large model.
      intake_threads: worker threads that tokenize prompts, render chat templates and compile
        output constraints, off the event loop.

    Raises:
      ValueError: a limit below 1 (``engine_stall_seconds`` must be > 0).
    """

    max_n: int = 128
    max_request_bytes: int = 8 * 2**20
    ignore_unknown_fields: bool = False
    engine_stall_seconds: float = 60.0
    intake_threads: int = 2

    def __post_init__(self):
        for name in ("max_n", "max_request_bytes", "intake_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerOptions.{name}={getattr(self, name)}: must be >= 1")
        if not self.engine_stall_seconds > 0:
            raise ValueError(f"ServerOptions.engine_stall_seconds={self.engine_stall_seconds}: "
                             "must be > 0")


def request_models(options: ServerOptions, *, max_model_len: int, vocab_size: int,
                   max_logprobs: int, max_stop_ids: int = 8) -> dict[str, type]:
    """``{"completions": model, "chat": model}``: the request models of one server, narrowed to
    its limits (pydantic subclasses of :class:`CompletionRequest` / :class:`ChatCompletionRequest`
    of the same names)."""
    token_id = Annotated[int, Field(ge=0, lt=vocab_size)]
    ids = Annotated[list[token_id], Field(min_length=1)]
    room = Annotated[int, Field(ge=1, le=max(max_model_len - 1, 1))]
    logprobs = Annotated[int, Field(ge=0, le=min(max(max_logprobs, 0), 20))]
    common = dict(
        prompt_logprobs=(logprobs | None, None),
        n=(Annotated[int, Field(ge=1, le=options.max_n)], 1),
        max_tokens=(room | None, None),
        min_tokens=(Annotated[int, Field(ge=0, le=max(max_model_len - 1, 0))] | None, None),
        stop_token_ids=(Annotated[list[token_id], Field(max_length=max_stop_ids)] | None, None))
    completion = create_model(
        "CompletionRequest", __base__=CompletionRequest, __module__=__name__,
        prompt=(Union[str, ids, Annotated[list[str], Field(min_length=1, max_length=options.max_n)],
                      Annotated[list[ids], Field(min_length=1, max_length=options.max_n)]], ...),
        logprobs=(logprobs | None, None),
        best_of=(Annotated[int, Field(ge=1, le=options.max_n)] | None, None), **common)
    chat = create_model(
        "ChatCompletionRequest", __base__=ChatCompletionRequest, __module__=__name__,
        max_completion_tokens=(room | None, None), top_logprobs=(logprobs | None, None), **common)
    return {"completions": completion, "chat": chat}


def _walk(obj, path: str, top: str | None):
    """Yield ``(path, top-level field, string)`` for every string (keys too) in ``obj``."""
    stack = [(obj, path, top)]
    while stack:
        item, where, field = stack.pop()
        if isinstance(item, str):
            yield where, field, item
        elif isinstance(item, dict):
            for k, v in item.items():
                sub = f"{where}.{k}" if where else str(k)
                yield sub, field or k, k
                stack.append((v, sub, field or k))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]", field) for i, v in enumerate(item))


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _loc_path(obj, loc) -> tuple[str, list]:
    """The readable path of a pydantic error ``loc`` through ``obj`` (union tags such as
    ``'list[int]'`` skipped) and the keys / indices it follows in ``obj``."""
    text, steps, cur = "", [], obj
    for part in loc:
        if isinstance(part, int) and isinstance(cur, list) and 0 <= part < len(cur):
            text += f"[{part}]"
            steps.append(part)
            cur = cur[part]
        elif isinstance(part, str) and isinstance(cur, dict) and part in cur:
            text += f".{part}" if text else part
            steps.append(part)
            cur = cur[part]
        elif isinstance(part, str) and isinstance(cur, dict) and len(loc) and part == loc[-1]:
            text += f".{part}" if text else part      # a missing or unknown key
            steps.append(part)
    return text, steps


def _describe(model, obj: dict, errors: list[dict]) -> BadRequest:
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        paths = [_loc_path(obj, e["loc"])[0] for e in unknown]
        hint = ""
        if len(paths) == 1 and "." not in paths[0] and "[" not in paths[0]:
            known = [f.alias or name for name, f in model.model_fields.items()]
            close = difflib.get_close_matches(paths[0], known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        return BadRequest(f"unknown field{'s' if len(paths) > 1 else ''}: {', '.join(paths)}"
                          f"{hint}", paths[0].split(".")[0].split("[")[0])
    e = max(errors, key=lambda err: len(err["loc"]))   # the most specific (deepest) error
    path, steps = _loc_path(obj, e["loc"])
    param = str(steps[0]) if steps else None
    return BadRequest(f"{path}: {e['msg']}" if path else e["msg"], param)


def _drop(obj: dict, steps: list) -> bool:
    cur = obj
    for s in steps[:-1]:
        cur = cur[s]
    if isinstance(cur, dict) and steps and steps[-1] in cur:
        del cur[steps[-1]]
        return True
    return False


def parse_request(body: bytes, model, *, ignore_unknown_fields: bool = False
                  ) -> tuple[Any, list[str]]:
    """Validate a request body against ``model`` (a model of :func:`request_models`).

    Returns:
      ``(request, ignored)``: the model instance and the paths of the unknown fields dropped
      (empty unless ``ignore_unknown_fields``).

    Raises:
      BadRequest: an empty body (naming the required fields), a body that is not UTF-8, not
        JSON or not a JSON object, nested deeper than :data:`MAX_JSON_DEPTH`, a string with a
        lone surrogate (``param``: the top-level field), or a field the model refuses
        (``param``: the top-level field; unknown fields are listed).
    """
    required = [f.alias or name for name, f in model.model_fields.items() if f.is_required()]
    if not body.strip():
        raise BadRequest("the request body is empty: send a JSON object with "
                         f"{', '.join(map(repr, required))}", required[0] if required else None)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not UTF-8: byte 0x{body[e.start]:02x} at offset "
                         f"{e.start} ({e.reason})", None) from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise BadRequest(f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep",
                         None) from None
    except ValueError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}", None) from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request body must be a JSON object, not {type(obj).__name__}",
                         None)
    if json_depth(obj, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise BadRequest(f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep",
                         None)
    for path, field, s in _walk(obj, "", None):
        m = _SURROGATE.search(s)
        if m:
            raise BadRequest(f"{path}: the string holds a lone UTF-16 surrogate "
                             f"(U+{ord(m.group()):04X} at character {m.start()}), which is not "
                             "Unicode text", field)
    ignored: list[str] = []
    for _ in range(2):
        try:
            return model.model_validate(obj), ignored
        except ValidationError as e:
            errors = e.errors(include_url=False)
            unknown = [err for err in errors if err["type"] == "extra_forbidden"]
            if not (ignore_unknown_fields and unknown and not ignored):
                raise _describe(model, obj, errors) from None
            for err in unknown:
                path, steps = _loc_path(obj, err["loc"])
                if _drop(obj, steps):
                    ignored.append(path)
            if not ignored:
                raise _describe(model, obj, errors) from None
            log.warning("ignored unknown request fields: %s", ", ".join(ignored))
    raise AssertionError("unreachable")


__all__ = ["IGNORED_FIELDS_HEADER", "INT32_MAX", "MAX_JSON_DEPTH", "ServerOptions",
           "parse_request", "request_models"]
