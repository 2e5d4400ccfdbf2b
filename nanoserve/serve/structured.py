"""Structured output over HTTP: the request fields that ask for it, mapped to `structured_outputs`.

Clients ask for structured output in three dialects, and all three land on
one `SamplingParams.structured_outputs` (`StructuredOutputsParams`):

    OpenAI   "response_format": {"type": "json_object"}
             "response_format": {"type": "json_schema",
                                 "json_schema": {"name": ..., "schema": {...}, "strict": true}}
             ({"type": "text"} asks for nothing); the openai SDK's
             `chat.completions.parse(response_format=PydanticModel)` sends the json_schema form
    vLLM     "structured_outputs": {"json": ..., "regex": ..., "choice": [...], "grammar": ...,
                                    "json_object": true}
             and the older "guided_json", "guided_regex", "guided_choice", "guided_grammar"

`strict: true` allows only the properties the schema names (the SDK's parse
sends it); without it, other properties may appear too. A bad schema, regex
or grammar is a FieldError naming the field the client sent ("guided_regex",
"response_format.json_schema.schema"), which the route turns into a 400 while
the request is read: nothing is queued. (protocol.py's request models inherit
these fields; this module imports nothing of the server, so no import cycle.)
The engine does the rest (`nanoserve/structured_output.py`).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from nanoserve.errors import FieldError
from nanoserve.sampling_params import StructuredOutputsParams

MAX_CHARS = 65_536    # a schema's, regex's, grammar's or choices' text: longer is refused before parsing

class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")    # ("schema" is a name pydantic's BaseModel keeps)
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(BaseModel):
    """The request fields that ask for structured output (both endpoints have them)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None                  # vLLM: StructuredOutputsParams' fields
    guided_json: dict | str | None = None                   # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The StructuredOutputsParams these fields ask for (None: free text); FieldError naming the
        request's field."""
        asked = self._asked()
        if not asked:
            return None
        if len(asked) > 1:
            raise FieldError(asked[1], f"asks for structured output as {asked[0]} does: give one of them")
        param, fields = _fields_of(self, asked[0])
        _check_length(param, fields)
        try:
            return StructuredOutputsParams(**fields)
        except FieldError as exc:
            name = exc.field if asked[0] == "structured_outputs" else param
            raise FieldError(name, exc.text) from None
        except TypeError as exc:                            # an unknown key in structured_outputs
            raise FieldError("structured_outputs", "has a field StructuredOutputsParams does not have ("
                             f"{str(exc).split('got ')[-1]}); it has json, regex, choice, grammar, "
                             "json_object, additional_properties") from None

    def constraint_field(self) -> str | None:
        """The request field that asks for structured output, as errors name it (None: free text)."""
        asked = self._asked()
        return _fields_of(self, asked[0])[0] if asked else None

    def _asked(self) -> list[str]:
        asked = [name for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                   "guided_grammar") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            asked.insert(0, "response_format")
        return asked


def _check_length(param: str, fields: dict) -> None:
    """FieldError naming `param` when the constraint's text is longer than MAX_CHARS (compiling grows with it)."""
    size = 0
    for key, value in fields.items():
        if isinstance(value, str):
            size += len(value)
        elif isinstance(value, list):
            size += sum(len(c) + 1 if isinstance(c, str) else 1 for c in value)
        elif isinstance(value, dict):
            size += len(json.dumps(value, ensure_ascii=False))
    if size > MAX_CHARS:
        raise FieldError(param, f"is {size} characters long; the server compiles constraints of at most {MAX_CHARS}")


def _fields_of(body: StructuredFields, asked: str) -> tuple[str, dict]:
    """(the request field errors name, StructuredOutputsParams' keyword arguments) for one way of asking."""
    if asked == "response_format":
        fmt = body.response_format
        if fmt.type == "json_object":
            return "response_format", {"json_object": True}
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise FieldError("response_format.json_schema.schema", "is required for type json_schema")
        return "response_format.json_schema.schema", {"json": fmt.json_schema.schema_,
                                                      "additional_properties": not fmt.json_schema.strict}
    if asked == "structured_outputs":
        return "structured_outputs", dict(body.structured_outputs)
    kind = asked.removeprefix("guided_")
    return asked, {kind: getattr(body, asked)}
