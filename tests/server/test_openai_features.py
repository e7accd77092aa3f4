"""What OpenAI clients send, through the real `openai` client against a real server on loopback:
logprobs (chat and legacy completions, echo, streamed) equal transformers' log_softmax of the same
checkpoint; penalties and logit_bias equal a penalised greedy reference written from the definitions;
n choices with seeds; tool calls (named / required constrained by the tools' schemas, auto parsed);
history with tool results; bad values are 400s naming the field while others keep being served."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import scripted_drafter  # noqa: F401  (registers "scripted")
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from penalty_reference import greedy_reference
from server_utils import TOOL_SCHEMAS, TOOLS, openai_client
from specserve import SamplingParams
from specserve.server.prompts import messages_to_text

MESSAGES = [{"role": "user", "content": "def fibonacci(n):"}]


@pytest.fixture(scope="module")
def hf(llama_dir):
    return AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()


def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """float32 log_softmax [len(ids), V] of transformers' logits: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def check_chat_logprobs(entries, tokenizer, ref: torch.Tensor, first_row: int, k: int) -> None:
    for i, e in enumerate(entries):
        row = ref[first_row + i]
        top = row.topk(k)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)
        assert [t.token for t in e.top_logprobs] == [tokenizer.decode([t]) for t in top.indices.tolist()] or k == 0
        assert e.token == tokenizer.decode([int(row.argmax())])  # greedy: the top token
        assert e.logprob == pytest.approx(float(row.max()), abs=2e-3)


@pytest.mark.parametrize("drafter", ["scripted", None])
def test_chat_logprobs_equal_transformers_whole_and_streamed(make_server, reference_llm, hf, drafter):
    prompt, _ = messages_to_text(reference_llm.tokenizer, MESSAGES)
    ids = reference_llm.encode(prompt)
    out = reference_llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    # The scripted drafter proposes trees mixing the greedy continuation with wrong tokens: steps accept
    # several tokens, and rejected rows must not leak into the log-probabilities.
    options = {"mode": "mixed", "seed": 1, "references": [ids + out.token_ids]} if drafter else None
    srv = make_server(llm_kwargs={"drafter": drafter, "drafter_options": options})
    client, llm = openai_client(srv), reference_llm
    ref = reference_logprobs(hf, ids + out.token_ids)
    resp = client.chat.completions.create(model=srv.server.model_name, messages=MESSAGES, max_tokens=24, temperature=0,
                                          logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    entries = resp.choices[0].logprobs.content
    assert len(entries) == 24
    check_chat_logprobs(entries, llm.tokenizer, ref, len(ids) - 1, 5)
    chunks = list(client.chat.completions.create(model=srv.server.model_name, messages=MESSAGES, max_tokens=24,
                                                 temperature=0, logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(streamed) == 24  # one entry per token, however many tokens a step accepted
    check_chat_logprobs(streamed, llm.tokenizer, ref, len(ids) - 1, 2)
    # With continuous usage stats every content chunk also carries the usage so far, and still its entries.
    chunks = list(client.chat.completions.create(
        model=srv.server.model_name, messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content and all(c.usage is not None for c in content)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    check_chat_logprobs(streamed, llm.tokenizer, ref, len(ids) - 1, 2)
    if drafter is not None:
        assert sum(resp.model_extra["spec"]["accepted_per_position"]) > 0  # several tokens per step happened


def test_completion_logprobs_with_echo_cover_the_prompt(server, reference_llm, hf):
    client, llm = openai_client(server), reference_llm  # the server's LLM belongs to its engine thread
    ids = llm.encode("def f(x):\n    return x")
    resp = client.completions.create(model=server.server.model_name, prompt=ids, max_tokens=8, temperature=0, logprobs=3,
                                     echo=True, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    full = ids + out.token_ids
    ref = reference_logprobs(hf, full)
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in full]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [float(ref[p - 1, full[p]]) for p in range(1, len(full))]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=2e-3)
    # {text: logprob}: tokens that decode alike share a key, so up to 3; the best is the row's maximum.
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert [max(top.values()) for top in lp.top_logprobs[1:]] == pytest.approx(
        [float(ref[p - 1].max()) for p in range(1, len(full))], abs=2e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(full))]
    assert resp.choices[0].text.startswith(llm.tokenizer.decode(ids))


def test_penalties_and_logit_bias_equal_the_penalised_reference(server, reference_llm, hf):
    client, llm = openai_client(server), reference_llm  # the server's LLM belongs to its engine thread
    plain = client.completions.create(model=server.server.model_name, prompt="x = [1, 2, 3]\nfor", max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})
    ids = llm.encode("x = [1, 2, 3]\nfor")
    banned = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].token_ids[1]
    resp = client.completions.create(model=server.server.model_name, prompt=ids, max_tokens=16, temperature=0,
                                     frequency_penalty=0.8, presence_penalty=0.5, logit_bias={str(banned): -100},
                                     extra_body={"ignore_eos": True, "repetition_penalty": 1.2})
    params = SamplingParams(frequency_penalty=0.8, presence_penalty=0.5, repetition_penalty=1.2,
                            logit_bias={banned: -100.0})
    expected = greedy_reference(hf, ids, params, (), 16)
    same = llm.generate([ids], dataclasses.replace(params, temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert same.token_ids == expected  # the served LLM's own output, as tokens, is the reference's
    assert resp.choices[0].text == same.text != plain.choices[0].text
    assert banned not in expected


def test_n_choices_with_seeds_are_reproducible(server):
    client = openai_client(server)

    def run():
        return client.completions.create(model=server.server.model_name, prompt="import", max_tokens=12, temperature=1.0,
                                         seed=11, n=3, extra_body={"ignore_eos": True})

    a, b = run(), run()
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each choice its own seed
    assert a.usage.completion_tokens == 36 and a.usage.prompt_tokens == len(server.server.llm.encode("import"))
    chunks = list(client.chat.completions.create(model=server.server.model_name, messages=MESSAGES, max_tokens=6,
                                                 temperature=0, n=2, stream=True, extra_body={"ignore_eos": True}))
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)}
    assert texts[0] == texts[1] and texts[0]  # greedy: equal choices
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]


def test_named_and_required_tool_calls_follow_the_schemas(server):
    client = openai_client(server)
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model=server.server.model_name, messages=[{"role": "user", "content": "weather?"}],
                                          max_tokens=60, temperature=0, tools=TOOLS, tool_choice=named)
    call = resp.choices[0].message.tool_calls[0]
    assert resp.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS["get_weather"])
    resp = client.chat.completions.create(model=server.server.model_name, messages=[{"role": "user", "content": "add?"}],
                                          max_tokens=60, temperature=0, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False)
    call = resp.choices[0].message.tool_calls[0]
    assert resp.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    chunks = list(client.chat.completions.create(model=server.server.model_name, max_tokens=60, temperature=0,
                                                 messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                                                 tool_choice=named, stream=True))
    deltas = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls for d in c.choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.index == 0 for d in deltas)
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments for d in deltas)
    jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS["get_weather"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_parses_the_models_tool_call_syntax_and_history_is_accepted(server):
    client = openai_client(server)
    # The tiny model has no tool-call training: a regex scripts its output into Hermes' syntax.
    forced = '<tool_call>\\{"name": "add", "arguments": \\{"a": 4\\}\\}</tool_call>'
    resp = client.chat.completions.create(model=server.server.model_name, messages=[{"role": "user", "content": "4+?"}],
                                          max_tokens=120, temperature=0, tools=TOOLS, tool_choice="auto",
                                          extra_body={"guided_regex": forced})
    call = resp.choices[0].message.tool_calls[0]
    assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.content is None
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 4}
    history = [{"role": "user", "content": "4+?"},
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
               {"role": "tool", "tool_call_id": call.id, "content": "4"}]
    resp = client.chat.completions.create(model=server.server.model_name, messages=history, max_tokens=8, temperature=0,
                                          tools=TOOLS)
    assert resp.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"n": 0}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"audio": {"voice": "x"}}, "audio"),
])
def test_bad_values_are_400_naming_the_field_and_others_are_served(server, body, param):
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.server.model_name, messages=MESSAGES, max_tokens=4, **body)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.server.model_name, prompt="x", max_tokens=4, best_of=2)
    assert err.value.body["param"] == "best_of"
    ok = client.chat.completions.create(model=server.server.model_name, messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_tool_arguments_hold_the_declared_parameters_unless_the_schema_says_otherwise():
    """JSON Schema lets an object take undeclared keys; a constrained tool call's arguments do not (a small
    model otherwise invented keys until max_tokens and never completed the call), unless the tool's
    schema allows them itself."""
    from specserve.server.tool_calls import parse_tools

    closed = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    opened = {**closed, "additionalProperties": True}
    for params, extra_ok in ((closed, False), (opened, True)):
        body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}}}
        schema = json.loads(json.dumps(parse_tools(body).constraint("compact").value))
        jsonschema.validate({"city": "Paris"}, schema)
        valid = jsonschema.Draft202012Validator(schema).is_valid({"city": "Paris", "invented": 1})
        assert valid is extra_ok
