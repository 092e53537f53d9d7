"""The grammar's guarantee on random weights: 20 generated JSON schemas through the server,
and ``tool_choice: "required"`` over generated tools. Every output must parse and validate
(``jsonschema``): the model contributes nothing but noise, so only the grammar can make it
so. Schemas bound every value (string lengths, integer ranges, array sizes) so that noise
reaches the end of each document well within ``max_tokens``. The schema test first checks
that its seeded schemas hold every construct the generator makes (``FEATURES``).
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import jsonschema
import pytest
from server_harness import async_client, running

MODEL = "qwen3.5-tiny-random-v2"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
NUM_SCHEMAS = 20


def leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "null", "enum", "const"])
    if kind == "string":
        s: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, 8)}
        if rng.random() < 0.3:
            s["minLength"] = 1
        return s
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "enum":
        return {"enum": rng.sample(["a", "bc", "d e", 1, 2.5, True, None], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["x", 7, False])}
    return {"type": kind}


def value(rng: random.Random, depth: int) -> dict[str, Any]:
    r = rng.random()
    if depth < 2 and r < 0.2:
        return obj(rng, depth + 1)
    if depth < 2 and r < 0.35:
        return {"type": "array", "items": leaf(rng), "maxItems": rng.randint(0, 3)}
    return leaf(rng)


def obj(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(["id", "name", "size", "tags", "kind", "ok", "x", "note"],
                       rng.randint(1, 4))
    props = {n: value(rng, depth) for n in names}
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": [n for n in names if rng.random() < 0.7]}


FEATURES = {"string", "minLength", "integer", "number", "boolean", "null", "enum", "const",
            "array", "empty array", "nested object", "optional property"}


def features(schema: dict[str, Any], nested: bool = False) -> set[str]:
    """The constructs ``schema`` holds, in the names of ``FEATURES``."""
    if "enum" in schema or "const" in schema:
        return {"enum" if "enum" in schema else "const"}
    kind = schema["type"]
    if kind == "object":
        out = {"nested object"} if nested else set()
        if set(schema["required"]) != set(schema["properties"]):
            out.add("optional property")
        return out.union(*(features(v, True) for v in schema["properties"].values()))
    if kind == "array":
        return {"array"} | ({"empty array"} if schema["maxItems"] == 0 else set()) \
            | features(schema["items"], True)
    return {kind} | ({"minLength"} if "minLength" in schema else set())


def constrain(k: int, schema: dict[str, Any]) -> dict[str, Any]:
    """The schema through each of the three request fields in turn."""
    if k % 3 == 0:
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": f"s{k}", "schema": schema}}}
    if k % 3 == 1:
        return {"extra_body": {**NO_THINKING, "structured_outputs": {"json": schema}}}
    return {"extra_body": {**NO_THINKING, "guided_json": json.dumps(schema)}}


@pytest.fixture(scope="module")
def server(launch):
    with running(launch("--max-num-seqs", "16")) as s:
        yield s


def test_generated_schemas_all_parse_and_validate(server):
    rng = random.Random(0)
    schemas = [obj(rng) if k % 5 else value(rng, 1) for k in range(NUM_SCHEMAS)]
    assert set().union(*map(features, schemas)) == FEATURES
    assert any(s.get("type") != "object" for s in schemas)  # k % 5 == 0: any value at the top

    async def one(http, k: int, schema: dict[str, Any]):
        kw = constrain(k, schema)
        kw.setdefault("extra_body", NO_THINKING)
        out = await http.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Item {k} as JSON."}],
            max_tokens=400, temperature=1.0, seed=k, **kw)
        return out.choices[0]

    async def run_all():
        http = async_client(server)
        try:
            return await asyncio.gather(*(one(http, k, s) for k, s in enumerate(schemas)))
        finally:
            await http.close()

    for k, (schema, choice) in enumerate(zip(schemas, asyncio.run(run_all()))):
        assert choice.finish_reason == "stop", (k, schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_required_tool_choice_always_calls_a_listed_tool(server):
    rng = random.Random(99)
    requests = []
    for _ in range(10):
        names = rng.sample(["lookup", "send_mail", "resize", "plot", "ls"], rng.randint(1, 3))
        tools = {}
        for name in names:
            params = obj(rng, depth=1)
            params["required"] = list(params["properties"])[:1]
            tools[name] = params
        requests.append(tools)

    async def one(http, k: int, tools: dict[str, Any]):
        out = await http.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Do it."}], max_tokens=300,
            temperature=1.0, seed=k, tool_choice="required", extra_body=NO_THINKING,
            tools=[{"type": "function", "function": {"name": n, "parameters": p}}
                   for n, p in tools.items()])
        return out.choices[0]

    async def run_all():
        http = async_client(server)
        try:
            return await asyncio.gather(*(one(http, k, t) for k, t in enumerate(requests)))
        finally:
            await http.close()

    for tools, choice in zip(requests, asyncio.run(run_all())):
        calls = choice.message.tool_calls
        assert calls, choice
        for call in calls:
            assert call.function.name in tools
            jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])
