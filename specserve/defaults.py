"""The default sampling settings, defined once for every way in: `SamplingParams` (Python), the CLI
(`generate`, `chat`), the OpenAI-compatible HTTP API, websocket sessions and the chat page — and the
few choices those ways in validate (grammar drafting modes, weight quantizations, the log-probability
limit), so none of them keeps a copy.

Kept free of heavy imports: the CLI reads it while building its parser (`specserve --help` must not
import torch).

- ``temperature`` 1.0 (what OpenAI's API and `SamplingParams` have always used; 0 is greedy),
  ``top_p`` 1.0, ``top_k`` 0 and ``min_p`` 0.0 (no filtering), no ``seed``, no ``stop`` strings.
- ``max_tokens`` None: the rest of the context window (Python, `generate`, HTTP). A prompt plus an
  explicit ``max_tokens`` past the window is an error naming both numbers.
- Chats (websocket sessions, the page, `specserve chat`) keep ``CHAT_MAX_OUTPUT_TOKENS`` of the window
  for each reply, and drop the oldest turns to keep that room (see server/prompts.py): with "the
  rest of the context" a long conversation would leave its next reply no room at all.
"""

from __future__ import annotations

TEMPERATURE = 1.0
#: Most top log-probabilities per position (OpenAI's limit for top_logprobs).
MAX_LOGPROBS = 20
#: How constrained requests draft (`LLM(grammar_drafting=...)`, grammar/hooks.py).
GRAMMAR_DRAFTING = ("forced", "aware", "verify")
#: Weight quantizations `LLM(quantization=...)` offers (the CPU kernels' int8 and int4: llama.cpp's Q8_0 and
#: Q4_0 layouts).
QUANTIZATIONS = ("int8", "int4")
#: What `LLM(kv_cache_dtype=...)` / --kv-cache-dtype can store the KV cache as (the CPU kernels; float16 is opt-in).
KV_CACHE_DTYPES = ("float32", "float16")
TOP_P = 1.0
TOP_K = 0
MIN_P = 0.0
MAX_TOKENS: int | None = None
SEED: int | None = None
STOP: tuple[str, ...] = ()
IGNORE_EOS = False

#: Output tokens a chat reply may use when the client does not say (capped at the context window - 1).
CHAT_MAX_OUTPUT_TOKENS = 256

#: How streamed text is delivered: "off" sends each engine step's tokens as they come (the default for
#: API clients); "smooth" spreads a multi-token step over the time until the next step (chat windows).
STREAM_PACING = "off"
CHAT_STREAM_PACING = "smooth"


def sampling_defaults() -> dict:
    """The defaults as the websocket protocol names them (a session's ``defaults``; max_output_tokens apart)."""
    return {"temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K, "min_p": MIN_P, "seed": SEED,
            "stop": STOP, "ignore_eos": IGNORE_EOS}
