"""Routes that do not exist, outside /v1 too, answer in the API's JSON error shape (not plain text)."""

from __future__ import annotations

import http.client
import json


def request(port: int, method: str, path: str, headers: dict | None = None) -> tuple[int, str, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, resp.getheader("Content-Type", ""), json.loads(body)


def test_unknown_routes_are_json_errors(server):
    for method, path, headers, status, code in (
        ("GET", "/nope", None, 404, "not_found"),
        ("GET", "/v1/nope", None, 404, "not_found"),
        ("GET", "/other", {"Connection": "Upgrade", "Upgrade": "websocket"}, 404, "not_found"),
        ("POST", "/", None, 405, "method_not_allowed"),
    ):
        got, content_type, body = request(server.port, method, path, headers)
        assert got == status and content_type.startswith("application/json"), (path, got, content_type)
        error = body["error"]
        assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"], body
