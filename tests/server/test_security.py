"""The handshake: API key (401), browser Origin and loopback Host checks (403), and the HTTP routes."""

from __future__ import annotations

import http.client

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from wsclient import Conn


def status_of(url: str, **kwargs) -> int:
    with pytest.raises(InvalidStatus) as info:
        with connect(url, open_timeout=10, **kwargs):
            pass
    return info.value.response.status_code


def http_get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


@pytest.fixture(scope="module")
def keyed(llama_dir):
    from specserve.server import BackgroundServer, ServerConfig

    from specserve import LLM

    config = ServerConfig(port=0, threads=1, api_key="s3cret", allowed_origins=("http://localhost:3000",))
    with BackgroundServer(LLM(llama_dir), config) as srv:
        yield srv


def test_api_key_is_required(keyed):
    assert status_of(keyed.ws_url) == 401
    assert status_of(keyed.ws_url, additional_headers={"Authorization": "Bearer wrong"}) == 401
    assert status_of(keyed.ws_url + "?api_key=wrong") == 401
    with Conn(keyed.ws_url, additional_headers={"Authorization": "Bearer s3cret"}) as c:
        assert c.first["type"] == "session.created"
    with Conn(keyed.ws_url + "?api_key=s3cret") as c:
        assert c.first["type"] == "session.created"


def test_401_says_how_to_authenticate(keyed):
    status, headers, body = http_get(keyed.port, "/v1/ws", {"Connection": "Upgrade", "Upgrade": "websocket"})
    assert status == 401 and headers["www-authenticate"] == "Bearer" and b"api_key" in body


def test_browser_origins(keyed):
    key = "?api_key=s3cret"
    assert status_of(keyed.ws_url + key, origin="http://evil.example") == 403
    assert status_of(keyed.ws_url + key, origin="null") == 403
    for origin in (f"http://127.0.0.1:{keyed.port}", "http://localhost:3000"):
        with Conn(keyed.ws_url + key, origin=origin) as c:
            assert c.first["type"] == "session.created"


def test_only_loopback_host_names_on_a_loopback_bind(keyed):
    """DNS rebinding: a page at evil.example resolving to 127.0.0.1 sends Host: evil.example."""
    assert http_get(keyed.port, "/", {"Host": "evil.example"})[0] == 403
    assert http_get(keyed.port, "/", {"Host": f"localhost:{keyed.port}"})[0] == 200
    assert http_get(keyed.port, "/", {"Host": f"[::1]:{keyed.port}"})[0] == 200


def test_http_routes(server):
    status, headers, body = http_get(server.port, "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert b"/v1/ws" in body and b'id="stop"' in body
    assert http_get(server.port, "/nope")[0] == 404
    assert http_get(server.port, "/v1/ws")[0] == 426  # a websocket endpoint, not a page
    assert http_get(server.port, "/other", {"Connection": "Upgrade", "Upgrade": "websocket"})[0] == 404
