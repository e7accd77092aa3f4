"""specserve: a latency-first speculative decoding serving stack.

    from specserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-dir", drafter="ngram")
    out = llm.generate("def f(x):", SamplingParams(max_tokens=64, temperature=0.0))[0]
"""

__version__ = "0.1.0"

from specserve.llm import LLM
from specserve.request import RequestOutput, SpecStats
from specserve.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecStats", "__version__"]
