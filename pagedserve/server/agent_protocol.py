"""The OpenAI wire format of tools, tool calls and output constraints.

Request side: ``tools`` (function tools only), ``tool_choice``, assistant ``tool_calls`` in
the history, ``response_format`` and vLLM's ``structured_outputs``. Response side: a
message's ``tool_calls`` and their streamed pieces. Objects that configure a constraint
refuse fields they do not know (``extra="forbid"``): a constraint silently half-applied is
worse than a 400.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

MAX_TOOLS = 128
MAX_NAME_CHARS = 64  # OpenAI's limit on a function name
FUNCTION_NAME = r"^[A-Za-z0-9_.\-]+$"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_input(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunctionIn(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"

    def arguments_object(self) -> dict[str, Any]:
        """The arguments as a mapping (templates iterate over them); ``ValueError`` if the
        JSON text is not an object."""
        if isinstance(self.arguments, dict):
            return self.arguments
        try:
            value = json.loads(self.arguments or "{}")
        except ValueError as exc:
            raise ValueError(f"tool call arguments are not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("tool call arguments must be a JSON object")
        return value


class ToolCallIn(_Lenient):
    """An assistant message's earlier call, as the history sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunctionIn


# ---- constraints ----------------------------------------------------------------------
class JsonSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs 'json_schema'")
        return self


class StructuredOutputsParams(_Strict):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``,
    ``json_object``."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [k for k in ("json_", "regex", "choice") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            names = [k.rstrip("_") for k in given]
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             f"json_object; got {names or 'none'}")
        return self


# ---- responses ------------------------------------------------------------------------
class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A streamed piece of call ``index``: the first has ``id``, ``type`` and the name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}
