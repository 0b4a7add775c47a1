"""A request's output constraint: OpenAI's ``response_format``, vLLM's ``structured_outputs``
object and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
fields, and the tool constraint of :mod:`~jmtp.runtime.serve.server.tools`, resolved to one
:class:`~jmtp.runtime.host.structured.params.StructuredOutputsParams`.

A request sets at most one of them (several: HTTP 400). :class:`Constraint` remembers the request
field the constraint came from, so an error about it (the ``InvalidRequestError.field``
``"structured_outputs.json"`` that ``StructuredOutputsParams`` or the engine's grammar compiler
raise) names the field the client sent: ``response_format``, ``tools``, ``guided_json``, or
``structured_outputs.<kind>`` itself.
"""
from __future__ import annotations

import dataclasses

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.host.structured.params import StructuredOutputsParams
from jmtp.runtime.serve.server.protocol import BadRequest, client_message

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A resolved output constraint and the request field (``param``) it came from."""

    params: StructuredOutputsParams
    param: str

    def rename(self, field: str | None) -> str | None:
        """The request field an error about ``field`` names (:func:`request_field`)."""
        return request_field(field, self.param)


def request_field(field: str | None, source: str) -> str | None:
    """A ``structured_outputs.*`` error field of a constraint that came from request field
    ``source`` is ``source``, unless the client sent ``structured_outputs`` itself."""
    if field is not None and field.startswith("structured_outputs") \
            and source != "structured_outputs":
        return source
    return field


def _response_format(rf) -> dict | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise BadRequest('response_format: type "json_schema" needs '
                             '"json_schema": {"name": ..., "schema": {...}}', "response_format")
        return {"json": rf.json_schema.schema_}
    raise BadRequest(f"response_format: unknown type {rf.type!r} (supported: "
                     f"{', '.join(RESPONSE_FORMAT_TYPES)})", "response_format")


def _structured_outputs(so) -> dict:
    """The ``StructuredOutputsParams`` keyword arguments of a ``structured_outputs`` object
    (:class:`~jmtp.runtime.serve.server.protocol.StructuredOutputsRequest`)."""
    if so.structural_tag is not None:
        raise BadRequest("structured_outputs.structural_tag is not supported",
                         "structured_outputs.structural_tag")
    # json_object=false means "not this kind"; vLLM's layout options (whitespace, fallback) do
    # not apply: the JSON layout is fixed (StructuredOutputsParams).
    kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
             "json_object": so.json_object}
    return {k: v for k, v in kinds.items() if v is not None and v is not False}


def constraint_sources(req) -> list[tuple[str, dict]]:
    """``(request field, StructuredOutputsParams keyword arguments)`` for every output constraint
    ``req`` (either endpoint) sets, in request order; tools are added by the caller.

    Raises:
      BadRequest: an unknown ``response_format`` type, ``json_schema`` without a schema, or
        ``structured_outputs.structural_tag``.
    """
    out = []
    if req.response_format is not None:
        kw = _response_format(req.response_format)
        if kw is not None:
            out.append(("response_format", kw))
    if req.structured_outputs is not None:
        out.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            out.append((f"guided_{kind}", {kind: value}))
    return out


def resolve(sources: list[tuple[str, dict]]) -> Constraint | None:
    """The one constraint of ``sources`` (None for none), validated.

    Raises:
      BadRequest: several sources (``param`` = the second), or the constraint is invalid
        (``param`` = its request field, see :meth:`Constraint.rename`).
    """
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise BadRequest(f"a request takes one output constraint, got several: {names}",
                         sources[1][0])
    param, kw = sources[0]
    try:
        params = StructuredOutputsParams(**kw)
    except InvalidRequestError as e:
        raise BadRequest(f"{param}: {client_message(e)}", request_field(e.field, param)) from e
    return Constraint(params, param)
