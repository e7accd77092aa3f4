"""`specserve serve` on SIGTERM: stops accepting, lets running responses finish within --shutdown-grace,
cancels the rest with their terminal event, exits 0 (a real server subprocess on loopback)."""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from wsclient import Conn

ENV = dict(os.environ, OMP_NUM_THREADS="1")


class Server:
    def __init__(self, model_dir, grace: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specserve", "serve", "--model", str(model_dir), "--port", "0", "--threads", "1",
             "--drafter", "none", "--shutdown-grace", str(grace), "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        self.stderr: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.stderr.put(line) for line in self.proc.stderr], daemon=True).start()
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            line = self.wait_stderr("ws://", timeout=120)  # the banner, a status line on stderr
            self._url = re.search(r"ws://\S+/v1/ws", line).group(0)
        return self._url

    def wait_stderr(self, needle: str, timeout: float = 10) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.stderr.get(timeout=max(0.01, deadline - time.monotonic()))
            if needle in line:
                return line

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def servers(noeos_dir):
    """Both servers start at once (their start-up is most of these tests' time): a long grace and a short one."""
    started = {"long": Server(noeos_dir, grace=15), "short": Server(noeos_dir, grace=0.2)}
    yield started
    for srv in started.values():
        srv.kill()


def test_running_response_finishes_within_the_grace(servers):
    srv = servers["long"]
    with Conn(srv.url) as c:
        rid = c.create(input="def f(x):", max_output_tokens=1200, temperature=0)
        c.wait_delta(rid)
        srv.proc.send_signal(signal.SIGTERM)
        srv.wait_stderr("shutting down")
        with pytest.raises(OSError):  # no longer listening
            Conn(srv.url, open_timeout=2)
        err = c.expect_error({"type": "response.create", "response": {"input": "x", "max_output_tokens": 4}})
        assert err["error"]["code"] == "server_busy" and "shutting down" in err["error"]["message"]
        done = c.wait_done(rid, timeout=20)
        assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 1200, done
        assert srv.proc.wait(20) == 0


def test_past_the_grace_the_rest_is_cancelled_with_a_terminal_event(servers):
    srv = servers["short"]
    with Conn(srv.url) as c:
        rid = c.create(input="def f(x):", max_output_tokens=2000, temperature=0)
        c.wait_delta(rid)
        conn = http.client.HTTPConnection("127.0.0.1", int(re.search(r":(\d+)/", srv.url).group(1)), timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2000, "stream": True}),
                     {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: {")
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        done = c.wait_done(rid, timeout=10)
        assert done["status"] == "cancelled" and 0 < done["usage"]["output_tokens"] < 2000, done
        assert [e["type"] for e in c.log].count("response.done") == 1
        events = [line[6:] for line in stream.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "stopping" in json.loads(events[-2])["error"]["message"], events[-3:]
        assert srv.proc.wait(10) == 0
        assert time.monotonic() - t0 < 8


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_negative_grace_is_one_line(capsys, llama_dir, value):
    from specserve.cli import main

    assert main(["serve", "--model", str(llama_dir), "--shutdown-grace", value]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "shutdown_grace" in err and "Traceback" not in err, err
