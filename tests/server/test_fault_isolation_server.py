"""A target forward that fails mid-session: the response in that step ends with a terminal error
event, its KV is freed, and the same session (and the server) go on serving."""

from __future__ import annotations

from server_utils import greedy_text, kv_blocks, wait_until
from wsclient import Conn


def arm_forward_failure(engine) -> None:
    """The engine's next target forward raises (once)."""
    run, armed = engine.runner.run, [True]

    def flaky(step, trees):
        if armed[0]:
            armed[0] = False
            raise RuntimeError("injected forward failure")
        return run(step, trees)

    engine.runner.run = flaky


def test_forward_failure_ends_the_response_with_an_error_and_the_session_goes_on(make_server, reference_llm):
    srv = make_server()
    with Conn(srv.ws_url) as c:
        srv.engine_call(arm_forward_failure)
        rid = c.create(input="def f(x):", max_output_tokens=12, temperature=0, ignore_eos=True)
        done = c.wait_done(rid)
        assert done["status"] == "failed" and done["error"]["code"] == "internal_error", done
        assert "RuntimeError" in done["error"]["message"] and "injected" not in done["error"]["message"]
        assert [e["type"] for e in c.log].count("response.done") == 1
        rid = c.create(input="def f(x):", max_output_tokens=12, temperature=0, ignore_eos=True)
        assert c.wait_done(rid)["status"] == "incomplete"  # max_output_tokens reached
        assert c.text(rid) == greedy_text(reference_llm, "def f(x):", 12, ignore_eos=True)
    assert srv.engine_call(lambda e: e.forward_failures) == 1
    free, total = wait_until(lambda: (lambda f: f if f[0] == f[1] else None)(kv_blocks(srv)))
    assert free == total
