"""Choosing a drafter per session / per request on a server that loaded a hybrid drafter: the server's
drafter, any one of its parts, or none — over the websocket, the OpenAI API (the real `openai` client)
and the chat page's drafter menu (real Chromium). Output stays plain greedy's whatever is chosen."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from server_utils import greedy_text, kv_blocks, wait_until
from wsclient import Conn

HYBRID = "hybrid:ngram+suffix"
PROMPT = "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n"


@pytest.fixture(scope="module")
def hybrid_server(llama_dir):
    from specserve import LLM
    from specserve.server import BackgroundServer, ServerConfig

    with BackgroundServer(LLM(llama_dir, drafter=HYBRID, speculation="static"), ServerConfig(port=0, threads=1)) as srv:
        yield srv


def test_a_session_may_choose_the_hybrid_one_part_or_none(hybrid_server, reference_llm):
    expected = greedy_text(reference_llm, PROMPT, 40, ignore_eos=True)
    with Conn(hybrid_server.ws_url) as c:
        assert c.session["drafter"] == HYBRID
        assert c.session["available_drafters"] == [HYBRID, "ngram", "suffix", "none"]
        # A first reply teaches the suffix part (it indexes finished outputs): later ones are drafted from it.
        c.wait_done(c.create(input=PROMPT, max_output_tokens=40, temperature=0, ignore_eos=True))
        for choice, sources in ((HYBRID, {"ngram", "suffix", "ngram+suffix"}), ("suffix", {"suffix"}),
                                ("ngram", {"ngram"}), ("none", set())):
            reply = c.request({"type": "session.update", "session": {"drafter": choice}})
            assert reply["session"]["drafter"] == (None if choice == "none" else choice)
            rid = c.create(input=PROMPT, max_output_tokens=40, temperature=0, ignore_eos=True)
            done = c.wait_done(rid)
            assert c.text(rid) == expected, choice
            by_drafter = done["spec"].get("accepted_by_drafter", {})
            assert set(by_drafter) <= sources, (choice, by_drafter)
            assert sum(by_drafter.values()) == sum(done["spec"]["accepted_per_position"]), choice
            if choice in (HYBRID, "suffix"):
                assert by_drafter, choice
        err = c.request({"type": "session.update", "session": {"drafter": "eagle"}})
        assert err["type"] == "error" and err["error"]["code"] == "drafter_unavailable"
        assert "'suffix'" in err["error"]["message"] and err["error"]["param"] == "session.drafter"
    assert wait_until(lambda: kv_blocks(hybrid_server)[0] == kv_blocks(hybrid_server)[1])


def test_an_openai_request_may_name_a_part(hybrid_server, reference_llm):
    client = openai.OpenAI(base_url=hybrid_server.openai_base_url, api_key="unused", max_retries=0, timeout=60)
    model = hybrid_server.server.model_name
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0,
                                    extra_body={"drafter": "suffix", "ignore_eos": True})
    assert out.choices[0].text == greedy_text(reference_llm, PROMPT, 32, ignore_eos=True)
    assert set(out.model_extra["spec"].get("accepted_by_drafter", {})) <= {"suffix"}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body={"drafter": "medusa"})
    assert err.value.body["param"] == "drafter" and "not loaded" in err.value.body["message"]


def test_the_chat_pages_drafter_menu_switches_the_sessions_drafter(hybrid_server):
    from cdp import CHROMIUM, Chromium

    if not Path(CHROMIUM).exists():
        pytest.skip(f"needs Debian's chromium at {CHROMIUM} (.ci/run installs it)")
    with Chromium(hybrid_server.http_url) as page:
        page.wait_for("document.getElementById('status').dataset.state === 'ready'")
        options = page.eval("[...document.querySelectorAll('#drafter option')].map(o => o.value)")
        assert options == [HYBRID, "ngram", "suffix", "none"]
        assert page.eval("document.getElementById('drafter').value") == HYBRID
        page.set_value("#drafter", "suffix")
        page.wait_for("document.getElementById('model').textContent.endsWith('drafter suffix')")
        page.set_value("#drafter", "none")
        page.wait_for("document.getElementById('model').textContent.endsWith('no drafter')")
        assert page.eval("document.getElementById('drafter').value") == "none"
        assert page.eval("document.getElementById('error').textContent") == ""
