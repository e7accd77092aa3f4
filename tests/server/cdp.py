"""Drive a real headless Chromium over the Chrome DevTools Protocol (its own websocket), no extra packages.

    with Chromium(url) as page:
        page.wait_for("document.readyState === 'complete'")
        page.click("#send")
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--remote-debugging-port=0",
    "--window-size=1000,800",
]


class JSError(AssertionError):
    pass


class Chromium:
    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.profile = tempfile.mkdtemp(prefix="specserve-chromium-")
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", url],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._ids = itertools.count(1)
        try:
            port = self._devtools_port(timeout)
            self.ws = connect(self._page_ws_url(port, timeout), max_size=None, open_timeout=timeout).__enter__()
        except Exception:
            self.close()
            raise

    def _devtools_port(self, timeout: float) -> int:
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited: {self.proc.stderr.read().decode(errors='replace')[-2000:]}")
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().splitlines()[0])
            time.sleep(0.05)
        raise TimeoutError("chromium did not open its DevTools port")

    @staticmethod
    def _page_ws_url(port: int, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout) as r:
                pages = [t for t in json.load(r) if t["type"] == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.05)
        raise TimeoutError("chromium opened no page")

    def call(self, method: str, timeout: float = 30.0, **params) -> dict:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(max(0.01, deadline - time.monotonic())))
            if msg.get("id") == msg_id:  # anything else is an event we did not subscribe to
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise JSError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, interval: float = 0.01):
        """Poll until ``expression`` is truthy; while the page loads it may throw, which counts as not yet."""
        deadline = time.monotonic() + timeout
        error = None
        while True:
            try:
                value = self.eval(expression)
            except JSError as exc:
                value, error = None, exc
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {expression!r}" + (f" (last error: {error})" if error else ""))
            time.sleep(interval)

    def click(self, selector: str) -> None:
        """A real mouse click at the element's centre."""
        box = self.eval(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                        " return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left", clickCount=1)

    def type(self, selector: str, text: str) -> None:
        """Focus an input and type into it as a keyboard would (input events fire)."""
        self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def set_value(self, selector: str, value: str) -> None:
        self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.value = {json.dumps(value)};"
                  " e.dispatchEvent(new Event('input')); e.dispatchEvent(new Event('change')); })()")

    def screenshot(self, path) -> Path:
        """The page as it is drawn now, as a PNG at ``path``."""
        import base64

        path = Path(path)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        try:
            if getattr(self, "ws", None) is not None:
                self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
