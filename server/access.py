"""Who may talk to the server: the same rules for the websocket, the HTTP API and the page.

- Bound to a loopback address, only loopback ``Host`` names are served (DNS-rebinding defence: a page
  at evil.example that resolves to 127.0.0.1 still sends ``Host: evil.example``).
- A browser's ``Origin`` must be this server's own origin or one listed in ``allowed_origins``
  (``"*"``: any). Requests without an Origin (curl, SDKs, the CLI) are not browsers and pass.
- With an API key, ``Authorization: Bearer KEY`` (or ``?api_key=KEY``, for the browser page's
  websocket, which cannot set headers) is required on the websocket and on ``/v1/*``.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import parse_qs, urlsplit


class Access:
    def __init__(self, bind_host: str, api_key: str | None, allowed_origins: tuple[str, ...]) -> None:
        self.loopback_only = is_loopback(bind_host)
        self.api_key = api_key
        self.allowed_origins = allowed_origins

    def host_allowed(self, host: str | None) -> bool:
        if not self.loopback_only:
            return True
        if not host:
            return False
        name = urlsplit("//" + host).hostname or ""
        return name == "localhost" or name.endswith(".localhost") or is_loopback(name)

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        origin = origin.rstrip("/")
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and host is not None and parts.netloc.lower() == host.lower()

    def cross_origin(self, origin: str, host: str | None) -> bool:
        """An allowed Origin other than our own: its responses need CORS headers for the browser to read them."""
        parts = urlsplit(origin.rstrip("/"))
        return host is None or parts.netloc.lower() != host.lower()

    def key_ok(self, auth: str | None, query: str) -> bool:
        if self.api_key is None:
            return True
        key = self.api_key.encode()
        candidates = []
        if auth and auth[:7].lower() == "bearer ":
            candidates.append(auth[7:].strip())
        candidates += parse_qs(query).get("api_key", [])
        return any(hmac.compare_digest(c.encode(), key) for c in candidates)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
