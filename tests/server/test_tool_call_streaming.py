"""Streamed `tool_choice: "required"` calls go out as they are generated, in OpenAI's delta shape (a
call's first delta: index, id, type, function.name; then function.arguments fragments), through the real
`openai` client against a real server; the fragments join into the same arguments the whole response
returns; the scanner behind it opens each call once its name is complete and sends every new piece of
its arguments, whatever the split of the text."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server_utils import TOOL_SCHEMAS, TOOLS, openai_client

from specserve.server.tool_calls import RequiredStream, scan_required



@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_stream_incrementally_and_equal_the_whole_response(server, parallel):
    client = openai_client(server)
    kwargs = dict(model=server.server.model_name, messages=[{"role": "user", "content": "weather?"}], max_tokens=120,
                  temperature=0, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    with_calls = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls]
    deltas = [d for i in with_calls for d in chunks[i].choices[0].delta.tool_calls]
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index not in calls:  # a call opens with its id, type and name
            assert d.id and d.id.startswith("call_") and d.type == "function" and d.function.name
            calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
        else:  # then only argument fragments
            assert d.id is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments
    assert sorted(calls) == list(range(len(calls))) and (parallel or len(calls) == 1)
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(calls[j]["name"], calls[j]["arguments"]) for j in sorted(calls)] == expected
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), TOOL_SCHEMAS[call["name"]])
    # (How many chunks carry them depends on the steps: forced grammar tokens can bring a whole short call in
    # one step, and a reader that falls behind gets queued text merged; the split is tested below.)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.parametrize("text", [
    '[{"name": "add", "arguments": {"a": 0, "s": "x}\\"]{"}}, {"name": "get_weather", "arguments": {"city": "P", "days": 3}}]',
    '{"name": "add", "arguments": {"a": [1, {"b": 2}], "c": "\\\\"}}',
])
def test_scanner_any_split_gives_the_same_calls(text):
    spans = [(c["name"], text[slice(*c["args"])]) for c in scan_required(text)]
    assert [(n, json.loads(a)) for n, a in spans] == [(v["name"], v["arguments"]) for v in
                                                     (json.loads(text) if text[0] == "[" else [json.loads(text)])]
    for step in (1, 2, 5, 11):
        stream, got, fragments = RequiredStream(), {}, 0
        for k in range(0, len(text), step):
            for d in stream.feed(text[k:k + step]):
                fragments += "id" not in d
                if "id" in d:
                    got[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
                else:
                    got[d["index"]][1] += d["function"]["arguments"]
        assert [tuple(got[j]) for j in sorted(got)] == spans
        assert fragments >= len(spans[0][1]) // step - 1  # every piece went out as it came
