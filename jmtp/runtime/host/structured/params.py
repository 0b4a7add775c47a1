"""User-facing structured-output parameters of one request (vLLM's ``StructuredOutputsParams``).

:class:`StructuredOutputsParams` says what the output must match: a JSON schema, any JSON
object, a regular expression, one of a list of strings, or a grammar (Lark, or GBNF/EBNF as
llama.cpp and xgrammar write it). :meth:`StructuredOutputsParams.grammar_source` turns it into
the llguidance grammar the engine compiles (:mod:`jmtp.runtime.host.structured.grammar`).

Every check that needs no tokenizer runs on construction and raises
:class:`~jmtp.core.errors.InvalidRequestError` (a ``ValueError``) naming the field as
``structured_outputs.<name>``: exactly one constraint, a JSON schema nested at most
:data:`MAX_SCHEMA_DEPTH` levels deep that is a valid JSON Schema (checked with the ``jsonschema``
package, whose recursive checks the depth bound keeps off Python's recursion limit), a regex Python can compile, a non-empty ``choice``
list of strings. Grammar errors the compiler finds (an unknown rule, a schema feature llguidance
does not implement) are raised the same way when the request is added, before it runs.
"""
from __future__ import annotations

import dataclasses
import json
import re
import reprlib
from typing import Any, Sequence

import jsonschema

from jmtp.core.checks import json_depth
from jmtp.core.errors import InvalidRequestError

#: JSON layout the JSON constraints force: one space after ``:`` and ``,`` and no other
#: whitespace (vLLM's ``disable_any_whitespace`` with the usual separators). Free whitespace
#: lets small models loop on newlines inside an object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

KINDS = ("json", "regex", "choice", "grammar", "json_object")
#: Deepest nesting of objects and arrays a JSON-schema constraint may have (a property's schema
#: sits two levels below its object's: ``{"properties": {"name": {...}}}``), so 32 nested objects.
#: OpenAI's structured outputs allow 10 levels of object nesting.
MAX_SCHEMA_DEPTH = 64
_TOO_DEEP = f"nested more than {MAX_SCHEMA_DEPTH} levels deep (objects and arrays)"


_REPR = reprlib.Repr()      # bounded depth: a value may be nested past the recursion limit
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxstring = 4, 8, 8, 200


def _error(field: str, value, limit: str) -> InvalidRequestError:
    text = _REPR.repr(value)
    if len(text) > 200:
        text = text[:200] + "..."
    return InvalidRequestError(f"StructuredOutputsParams.{field}={text}: {limit}",
                               f"structured_outputs.{field}")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (exactly one field set).

    Fields:
      json: a JSON schema (a dict, or its JSON text). The output is one JSON value valid against
        it, written with ``", "`` / ``": "`` separators and no other whitespace.
      regex: a regular expression the whole output must match.
      choice: a non-empty list of strings; the output is one of them.
      grammar: a context-free grammar: Lark syntax (llguidance's dialect), or GBNF/EBNF
        (``root ::= ...``, llama.cpp / xgrammar), converted to Lark.
      json_object: True for any JSON object (OpenAI's ``response_format={"type":
        "json_object"}``).

    The request's EOS ends the output only where the constraint is complete.

    Raises:
      InvalidRequestError: (a ``ValueError``, ``.field = "structured_outputs.<name>"``) for no
        or several constraints, an invalid JSON schema, a regex that does not compile or an
        empty / non-string ``choice``.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        set_fields = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise InvalidRequestError(
                f"StructuredOutputsParams: exactly one of {KINDS} must be set, got "
                f"{set_fields or 'none'}", "structured_outputs")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise _error("json", self.json, f"not JSON text ({e})") from None
                except RecursionError:      # nested past the JSON parser's own limit
                    raise _error("json", self.json, _TOO_DEEP) from None
            if not isinstance(schema, (dict, bool)):
                raise _error("json", self.json, "must be a JSON schema (an object)")
            if json_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
                raise _error("json", self.json, _TOO_DEEP)
            if schema is False:
                raise _error("json", self.json, "the schema false allows no output")
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as e:
                path = "/".join(str(p) for p in e.path)
                raise _error("json", self.json,
                             f"not a valid JSON Schema{' at ' + path if path else ''}: "
                             f"{e.message}") from None
            object.__setattr__(self, "json", schema)
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise _error("regex", self.regex, "must be a non-empty string")
            try:
                re.compile(self.regex)
            except re.error as e:
                raise _error("regex", self.regex, f"not a valid regular expression ({e})") from None
        if self.choice is not None:
            if (isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, Sequence)
                    or not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
                raise _error("choice", self.choice, "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str)
                                         or not self.grammar.strip()):
            raise _error("grammar", self.grammar, "must be a non-empty string")
        if self.json_object is not None and self.json_object is not True:
            raise _error("json_object", self.json_object, "must be True or None")

    @property
    def kind(self) -> str:
        """The constraint's field name: one of :data:`KINDS`."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_source(self) -> str:
        """The llguidance grammar (JSON text) of the constraint (no tokenizer needed).

        Raises:
          InvalidRequestError: a GBNF grammar llguidance's converter rejects.
        """
        import llguidance
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark
        M = llguidance.LLMatcher
        if self.json is not None:     # the schema `true` allows any JSON value
            schema = {} if self.json is True else self.json
            return M.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if self.json_object:
            return M.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.regex is not None:
            return M.grammar_from_regex(self.regex)
        if self.choice is not None:
            return M.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        text = self.grammar
        if "::=" in text:   # GBNF / EBNF (llama.cpp, xgrammar): llguidance converts it to Lark
            try:
                text = gbnf_to_lark(text)
            except (GbnfToLarkError, ValueError) as e:
                raise _error("grammar", self.grammar, f"not a valid GBNF grammar ({e})") from None
        return M.grammar_from_lark(text)

    def to_dict(self) -> dict[str, Any]:
        """The one set field as ``{name: value}`` (JSON-serialisable)."""
        value = getattr(self, self.kind)
        return {self.kind: list(value) if isinstance(value, tuple) else value}
