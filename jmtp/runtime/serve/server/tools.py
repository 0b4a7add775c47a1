"""Chat ``tools`` and ``tool_choice``: the output constraint of a forced tool call and the
``tool_calls`` of its response (OpenAI function tools).

* ``tool_choice="none"`` (or no tools): a plain chat; the template does not get the tools.
* ``"auto"`` (the default with tools): the chat template gets ``tools``; the output is not
  constrained and not parsed (free text stays ``content``, whatever the model wrote).
* ``"required"``: the output is a JSON array of one or more calls ``[{"name": <a tool's name>,
  "parameters": <its arguments>}]`` (:func:`required_schema`; one call with
  ``parallel_tool_calls=false``).
* named, ``{"type": "function", "function": {"name": X}}``: the output is X's arguments object,
  constrained to X's ``parameters`` schema.

For the last two, :meth:`ToolPlan.parse` turns the output into OpenAI ``tool_calls``
(``{"id": "call_...", "type": "function", "function": {"name", "arguments": <JSON text>}}``).
"""
from __future__ import annotations

import dataclasses
import json
import uuid

import jsonschema

from jmtp.core.checks import json_depth
from jmtp.runtime.host.structured.params import MAX_SCHEMA_DEPTH
from jmtp.runtime.serve.server.protocol import BadRequest

#: A tool without ``parameters`` takes any JSON object.
ANY_OBJECT = {"type": "object"}
# Keywords whose values are data (not schemas): their "$ref" keys are not references.
_DATA_KEYWORDS = ("const", "enum", "default", "examples")
# Keywords whose values map names to schemas (a property may be called "$ref" or "const").
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def embed_schema(schema, pointer: str):
    """``schema`` with its local references (``"$ref": "#/..."``) rewritten to resolve from
    JSON pointer ``pointer`` (``"#/a/b"``), where it is placed inside a larger schema."""
    if isinstance(schema, list):
        return [embed_schema(s, pointer) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = pointer + v[1:]
        elif k in _DATA_KEYWORDS:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: embed_schema(s, pointer) for name, s in v.items()}
        else:
            out[k] = embed_schema(v, pointer)
    return out


def required_schema(tools: dict[str, dict], max_calls: int | None = None) -> dict:
    """The JSON schema of ``tool_choice="required"``: an array of one or more (at most
    ``max_calls``) ``{"name": <tool name>, "parameters": <that tool's parameters>}`` objects."""
    variants = []
    for i, (name, params) in enumerate(tools.items()):
        variants.append({
            "type": "object",
            "properties": {"name": {"const": name},
                           "parameters": embed_schema(
                               params, f"#/items/anyOf/{i}/properties/parameters")},
            "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "items": {"anyOf": variants}, "minItems": 1}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def new_call(name: str, arguments: str) -> dict:
    """One OpenAI tool call with a fresh ``call_<hex>`` id."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools do.

    Attributes:
      mode: "none", "auto", "required" or "named".
      tools: ``{name: parameters schema}`` of the request's tools.
      template_tools: the ``tools`` passed to the chat template (None: none).
      named: the tool of ``mode="named"``.
      schema: the constraint's JSON schema ("required" and "named"), else None.
    """

    mode: str
    tools: dict
    template_tools: list | None = None
    named: str | None = None
    schema: dict | None = None

    @property
    def forced(self) -> bool:
        """The output is a tool call (constrained, parsed into ``tool_calls``)."""
        return self.schema is not None

    def parse(self, text: str) -> list[dict] | None:
        """The ``tool_calls`` of a forced call's output, or None when ``text`` is not one (cut by
        ``max_tokens`` or a stop string)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.mode == "named":
            return [new_call(self.named, text.strip())] if isinstance(value, dict) else None
        if not isinstance(value, list) or not value:
            return None
        calls = []
        for item in value:
            if not (isinstance(item, dict) and item.get("name") in self.tools
                    and "parameters" in item):
                return None
            calls.append(new_call(item["name"], json.dumps(item["parameters"],
                                                           ensure_ascii=False)))
        return calls


def plan_tools(req) -> ToolPlan:
    """The :class:`ToolPlan` of a chat request.

    Raises:
      BadRequest: ``param="tools"`` for two tools of one name or a ``parameters`` that is not a
        valid JSON Schema object or is nested deeper than ``MAX_SCHEMA_DEPTH``;
        ``param="tool_choice"`` for a forced choice without tools or a named tool that is not in
        ``tools``.
    """
    choice = req.tool_choice
    tools: dict[str, dict] = {}
    for i, tool in enumerate(req.tools or []):
        fn = tool.function
        where = f"tools[{i}].function"
        if fn.name in tools:
            raise BadRequest(f"{where}.name: two tools are named {fn.name!r}", "tools")
        params = ANY_OBJECT if fn.parameters is None else fn.parameters
        if not isinstance(params, dict):
            raise BadRequest(f"{where}.parameters: must be a JSON schema object", "tools")
        if json_depth(params, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise BadRequest(f"{where}.parameters: nested more than {MAX_SCHEMA_DEPTH} levels "
                             "deep (objects and arrays)", "tools")
        try:
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.SchemaError as e:
            at = "/".join(str(p) for p in e.path)
            raise BadRequest(f"{where}.parameters: not a valid JSON Schema"
                             f"{' at ' + at if at else ''}: {e.message}", "tools") from None
        tools[fn.name] = params
    if not tools:
        if choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice: a forced tool call needs `tools`", "tool_choice")
        return ToolPlan("none", {})
    if choice == "none":
        return ToolPlan("none", tools)
    template_tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice in (None, "auto"):
        return ToolPlan("auto", tools, template_tools)
    if choice == "required":
        max_calls = 1 if req.parallel_tool_calls is False else None
        return ToolPlan("required", tools, template_tools,
                        schema=required_schema(tools, max_calls))
    name = choice.function.name
    if name not in tools:
        raise BadRequest(f"tool_choice: no tool named {name!r} (tools: "
                         f"{', '.join(map(repr, tools))})", "tool_choice")
    return ToolPlan("named", tools, template_tools, named=name, schema=tools[name])
