"""A chat request's output constraint, as a grammar for the engine (``GrammarSpec``).

Sources, at most one per request (each names the field a 400 reports); all but
``tool_choice`` apply to completions too:

    response_format      {"type": "json_object"} or {"type": "json_schema", ...}
    structured_outputs   vLLM's: json, regex, choice, json_object
    guided_json / guided_regex / guided_choice   vLLM's older fields
    tool_choice          "required" or a named function: the model's own call syntax
                         (Qwen3.5's XML, parameters by each tool's schema)

When the reasoning parser is on and the prompt leaves the output inside ``<think>``, the
grammar first lets the thinking run free up to ``</think>`` and the template's blank line,
then constrains the answer (vLLM likewise constrains only what follows the reasoning).
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.engine.structured import GrammarSpec
from pagedserve.server.agent_protocol import NamedToolChoice
from pagedserve.server.assistant_output import OutputFormat
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import ChatCompletionRequest, ConstraintFields
from pagedserve.server.reasoning import CALL_OPEN, THINK_CLOSE, THINK_OPEN

CALL_BEGIN = "<tool_call>\n<function={name}>\n"
CALL_END = "\n</function>\n</tool_call>"
REASONING_END = "\n\n"  # Qwen3.5's template: "</think>" then a blank line, then the answer
# Whitespace allowed between JSON elements (indentation four levels deep fits) and between
# a call's parameters (the template writes one newline): bounded, so a model cannot spend
# its tokens on endless whitespace inside a grammar.
JSON_MAX_WHITESPACE = 16
CALL_MAX_WHITESPACE = 2


def tools_enabled(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def tool_schemas(body: ChatCompletionRequest) -> dict[str, dict[str, Any] | None]:
    """Function name -> parameters schema, for the parser."""
    return {t.function.name: t.function.parameters for t in body.tools or []}


def check_tool_choice(body: ChatCompletionRequest) -> None:
    """400 for a ``tool_choice`` the ``tools`` cannot satisfy."""
    names = [t.function.name for t in body.tools or []]
    if len(set(names)) != len(names):
        raise bad_request(f"tools must have distinct names, got {names}", param="tools")
    choice = body.tool_choice
    if choice == "required" and not names:
        raise bad_request("tool_choice 'required' needs at least one tool in 'tools'",
                          param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request(f"tool_choice names the function '{choice.function.name}', which "
                          f"is not in tools ({names})", param="tool_choice")


def _schema(value: Any, param: str) -> dict[str, Any] | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object or a boolean)",
                          param=param)
    return value


def json_format(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """The format of a JSON document that ``schema`` validates."""
    return {"type": "json_schema", "json_schema": schema,
            "max_whitespace_cnt": JSON_MAX_WHITESPACE}


def _choice(options: list[str]) -> dict[str, Any]:
    return {"type": "or", "elements": [{"type": "const_string", "value": o} for o in options]}


def _call_tag(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    schema: dict[str, Any] | bool = parameters if parameters is not None else True
    return {"type": "tag", "begin": CALL_BEGIN.format(name=name),
            "content": {"type": "json_schema", "json_schema": schema, "style": "qwen_xml",
                        "max_whitespace_cnt": CALL_MAX_WHITESPACE},
            "end": CALL_END}


def tool_call_format(tools: dict[str, dict[str, Any] | None], forced: str | None,
                     parallel: bool) -> dict[str, Any]:
    """The output is one call to ``forced``, or (``None``) one or more calls to ``tools``
    (just one unless ``parallel``), and nothing else."""
    if forced is not None:
        return _call_tag(forced, tools[forced])
    return {"type": "tags_with_separator", "separator": "\n", "at_least_one": True,
            "stop_after_first": not parallel,
            "tags": [_call_tag(name, params) for name, params in tools.items()]}


def _tool_format(body: ChatCompletionRequest) -> dict[str, Any]:
    forced = body.tool_choice.function.name \
        if isinstance(body.tool_choice, NamedToolChoice) else None
    return tool_call_format(tool_schemas(body), forced, body.parallel_tool_calls)


def _sources(body: ConstraintFields) -> list[tuple[str, dict[str, Any]]]:
    """(field, grammar format) of every output-format constraint the request asks for."""
    found = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", json_format({"type": "object"})))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        schema = rf.json_schema.schema_
        found.append(("response_format", json_format(
            {"type": "object"} if schema is None else _schema(schema, "response_format"))))
    so = body.structured_outputs
    if so is not None:
        if so.json_ is not None:
            fmt = json_format(_schema(so.json_, "structured_outputs.json"))
        elif so.regex is not None:
            fmt = {"type": "regex", "pattern": so.regex}
        elif so.choice is not None:
            fmt = _choice(so.choice)
        else:
            fmt = json_format({"type": "object"})
        found.append(("structured_outputs", fmt))
    if body.guided_json is not None:
        found.append(("guided_json", json_format(_schema(body.guided_json, "guided_json"))))
    if body.guided_regex is not None:
        found.append(("guided_regex", {"type": "regex", "pattern": body.guided_regex}))
    if body.guided_choice is not None:
        found.append(("guided_choice", _choice(body.guided_choice)))
    return found


def chat_constraint(body: ChatCompletionRequest,
                    fmt: OutputFormat) -> tuple[GrammarSpec, str] | None:
    """The grammar of ``body``'s output and the field it came from, or ``None``."""
    found = _sources(body)
    if tools_enabled(body) and (body.tool_choice == "required"
                                or isinstance(body.tool_choice, NamedToolChoice)):
        found.append(("tool_choice", _tool_format(body)))
    return _one(found, fmt)


def completion_constraint(body: ConstraintFields) -> tuple[GrammarSpec, str] | None:
    """The grammar of a completion's output (no reasoning, no tools), or ``None``."""
    return _one(_sources(body), OutputFormat())


def _one(found: list[tuple[str, dict[str, Any]]],
         fmt: OutputFormat) -> tuple[GrammarSpec, str] | None:
    if not found:
        return None
    if len(found) > 1:
        fields = [name for name, _ in found]
        raise bad_request(f"{fields} each constrain the output; send at most one",
                          param=fields[1])
    param, content = found[0]
    return grammar(content, fmt), param


def grammar(content: dict[str, Any], fmt: OutputFormat) -> GrammarSpec:
    """The spec that constrains the answer to ``content``, after any free reasoning."""
    if fmt.reasoning and fmt.in_reasoning:
        thinking = {"type": "tag", "begin": "", "end": THINK_CLOSE, "content": {
            "type": "any_text", "excludes": [THINK_OPEN, THINK_CLOSE, CALL_OPEN]}}
        content = {"type": "sequence", "elements": [
            thinking, {"type": "const_string", "value": REASONING_END}, content]}
    return GrammarSpec.of_format(content)
