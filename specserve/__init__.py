"""specserve: a latency-first speculative decoding serving stack.

    from specserve import LLM, SamplingParams
    llm = LLM(drafter="ngram")                   # the embedded default model
    out = llm.generate("def f(x):", SamplingParams(max_tokens=64, temperature=0.0))[0]
"""

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecStats", "__version__"]

# Imported on first use (PEP 562), so that `specserve --help` and the CLI's argument errors do not pay
# for importing torch.
_LAZY = {"LLM": "specserve.llm", "RequestOutput": "specserve.request", "SpecStats": "specserve.request",
         "SamplingParams": "specserve.sampling"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'specserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
