"""specserve: a latency-first speculative decoding serving stack.

    from specserve import LLM, SamplingParams
    llm = LLM(drafter="ngram")                   # the embedded default model
    out = llm.generate("def f(x):", SamplingParams(max_tokens=64, temperature=0.0))[0]
"""

from specserve.lazy import lazy_exports as _lazy_exports

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecStats", "__version__"]

# Imported on first use (PEP 562), so that `specserve --help` and the CLI's argument errors do not pay
# for importing torch.
_LAZY = {"LLM": "specserve.llm", "RequestOutput": "specserve.request", "SpecStats": "specserve.request",
         "SamplingParams": "specserve.sampling"}


__getattr__, __dir__ = _lazy_exports(__name__, _LAZY, globals())
