"""One log line per finished request, as text or JSON (``--log-format``), on the ``specserve.requests`` logger.

Fields: request id, api (openai | websocket), client (address, and the websocket session), status,
prompt tokens (and of them those the prefix cache served), output tokens, TTFT (ms, receipt to first token), tokens/s after the first token, τ.
"""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger("specserve.requests")

#: The order the text format prints the fields in.
FIELDS = ("id", "api", "client", "status", "prompt_tokens", "cached_tokens", "output_tokens", "ttft_ms", "tokens_per_s", "tau", "error")


def log_request(record: dict) -> None:
    """``record``: the fields above (None values are left out of the text line)."""
    if not log.isEnabledFor(logging.INFO):
        return
    text = " ".join(f"{k}={_show(record[k])}" for k in FIELDS if record.get(k) is not None)
    log.info("request %s", text, extra={"request": record})


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message; a request line's fields at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        request = getattr(record, "request", None)
        if request is not None:
            out["event"] = "request"
            out.update({k: v for k, v in request.items() if v is not None})
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str, fmt: str) -> None:
    """--log-level and --log-format for `specserve serve` (the root handler, replacing any earlier one)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's own access log would add a second line per request; ours says more.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
