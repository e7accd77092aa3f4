"""A new per-request rule plugs in through the step hooks alone — no engine edit — and speculation stays
lossless under it: its logits edit, its forced tokens and its stop verdict reach plain and speculative
decoding alike, and both equal a greedy reference computed here from transformers' logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.step_hooks import RequestRule, TokenVerdict

PROMPTS = ["def add(a, b):", "import os\n", "x = [1, 2, 3]\nfor"]
STOP_AFTER = 12


class BanAndStop(RequestRule):
    """Bans one token at every verify row, forces `forced` (a guess the target must verify), and stops the
    request after STOP_AFTER emitted tokens."""

    def __init__(self, banned: int, forced: list[int]) -> None:
        self.banned, self.forced, self.emitted = banned, forced, 0

    def process_logits(self, logits, tree) -> None:
        logits[:, self.banned] = float("-inf")

    def forced_tokens(self):
        return self.forced

    def accept_token(self, token: int):
        self.emitted += 1
        return TokenVerdict("stop") if self.emitted >= STOP_AFTER else None


def _reference(model_dir, prompt_ids: list[int], banned: int) -> list[int]:
    """Greedy decoding with `banned` masked, STOP_AFTER tokens, from transformers' own logits."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(STOP_AFTER):
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
            logits[banned] = float("-inf")
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_new_rule_plugs_in_through_the_hooks_and_keeps_greedy_lossless(llama_dir, drafter):
    llm = LLM(llama_dir, drafter=drafter, device="cpu", speculation="static")
    unruled = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STOP_AFTER, ignore_eos=True))
    banned = unruled[0].token_ids[1]  # a token greedy decoding really emits: the ban must bite
    forced = [unruled[1].token_ids[0], unruled[1].token_ids[1]]  # right for prompt 1's start, wrong elsewhere
    made = []

    def factory(request):
        if request.params.seed != 7:  # a rule for some requests only
            return None
        made.append(BanAndStop(banned, forced))
        return made[-1]

    llm.engine.hooks.rule_factories.append(factory)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, seed=7))
    assert len(made) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        assert banned not in out.token_ids
        assert out.token_ids == _reference(llama_dir, llm.encode(prompt), banned)
        assert out.finish_reason == "stop" and len(out.token_ids) == STOP_AFTER
    assert any(o.token_ids != u.token_ids for o, u in zip(outs, unruled))  # the rule changed something
    # Requests the factory declines are untouched.
    again = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STOP_AFTER, ignore_eos=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in unruled]


def test_a_constraint_without_a_rule_to_enforce_it_is_refused(llama_dir):
    llm = LLM(llama_dir, drafter=None, device="cpu")
    llm.engine.hooks.rule_factories.clear()  # an engine built without the constraint rules
    with pytest.raises(ValueError, match="enforces no output constraints"):
        llm.engine.add_request(llm.encode("x = "), SamplingParams(max_tokens=4, regex="[0-9]+"))
