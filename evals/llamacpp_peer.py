"""llama.cpp as a peer: the same checkpoint, converted to GGUF by the converter llama.cpp ships, run
through llama-cpp-python from the token ids our tokenizer produced.

Two things must be on the machine, and neither is a dependency of specserve:

- llama-cpp-python (``pip install -e ".[llamacpp]"``; it builds llama.cpp from source), and
- llama.cpp's converter, ``convert_hf_to_gguf.py`` with its ``gguf-py`` (and, in recent versions,
  its ``conversion`` package). llama-cpp-python's wheel does not install it, but its sdist carries
  it under ``vendor/llama.cpp``, so ``--llama-cpp-source`` / ``$LLAMA_CPP_SOURCE`` takes a llama.cpp
  checkout, that ``vendor/llama.cpp`` folder, or the unpacked sdist itself.

When either is missing the peer is skipped with one line saying what to install or pass
(`PeerUnavailable`); a source that is given but is not a converter tree is bad input (ValueError).

Conversion runs once per (checkpoint content, converter version, GGUF type), in a subprocess (the
converter imports torch, numpy and its own packages, and exits the process on some errors), into a
cache directory; llama.cpp's code is run from the user's llama.cpp tree, never copied here.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("specserve")

ENV_SOURCE = "LLAMA_CPP_SOURCE"
CONVERTER = "convert_hf_to_gguf.py"
INSTALL_HINT = 'pip install -e ".[llamacpp]"'
SOURCE_HINT = (f"pass --llama-cpp-source DIR or set ${ENV_SOURCE} to a llama.cpp checkout or an unpacked "
               "llama-cpp-python sdist (pip download --no-binary :all: --no-deps llama-cpp-python)")
# Bumped when what this module feeds the converter changes (the pre-tokenizer fallback, the stand-in
# tokenizer), so cached GGUF files from an older recipe are not reused.
RECIPE_VERSION = "1"
# Our CPU weight storage dtypes and the GGUF type that compares with each: float32 with f32;
# half-size storage (bf16 or fp16 in memory, fp32 arithmetic) with llama.cpp's f16.
# Our int8 and int4 quantizations are Q8_0's and Q4_0's layouts (8- or 4-bit weights, one float16 scale per
# 32), so they pair with q8_0 and q4_0. The converter writes f32 / f16 / q8_0 itself; q4_0 is quantized from its
# f32 file by llama.cpp's own quantizer (`_quantize_q4_0`).
GGUF_TYPE = {"float32": "f32", "bfloat16": "f16", "float16": "f16", "int8": "q8_0", "int4": "q4_0"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class PeerUnavailable(Exception):
    """llama.cpp cannot run here (a package or the converter is missing); str() is the one line to show."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options `bench decode --peer llama.cpp` and `eval --peers llama.cpp` share."""
    p.add_argument("--llama-cpp-source", default=None, metavar="DIR",
                   help=f"llama.cpp source tree holding {CONVERTER} (a checkout, or vendor/llama.cpp of the "
                        f"llama-cpp-python sdist); default ${ENV_SOURCE}")
    p.add_argument("--llama-cpp-cache", default=None, metavar="DIR",
                   help="where converted GGUF files are kept (default: $XDG_CACHE_HOME/specserve/gguf)")


def skip_line(reason: PeerUnavailable) -> str:
    return f"llama.cpp peer skipped: {reason}"


def find_converter(source: str | None) -> Path:
    """The llama.cpp source tree that holds the converter: `source`, else $LLAMA_CPP_SOURCE.

    Raises PeerUnavailable when neither is set, ValueError when the directory given holds no usable
    converter. An unpacked llama-cpp-python sdist is accepted for its vendor/llama.cpp.
    """
    what = "--llama-cpp-source"
    if not source:
        source = os.environ.get(ENV_SOURCE) or None
        what = f"${ENV_SOURCE}"
    if source is None:
        raise PeerUnavailable(f"llama.cpp's converter was not found: {SOURCE_HINT}")
    root = Path(source).expanduser()
    if not root.is_dir():
        raise ValueError(f"{what} {source!r} is not a directory")
    for tree in (root, root / "vendor" / "llama.cpp"):
        if (tree / CONVERTER).is_file():
            if not (tree / "gguf-py" / "gguf" / "__init__.py").is_file():
                raise ValueError(f"{what} {source!r} has {CONVERTER} but no gguf-py/gguf package next to it")
            return tree.resolve()
    raise ValueError(f"{what} {source!r} holds no {CONVERTER} (nor vendor/llama.cpp/{CONVERTER}): "
                     "give a llama.cpp source tree")


def require_llama_cpp() -> str:
    """llama-cpp-python's version; PeerUnavailable when it is not installed."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise PeerUnavailable(f"llama-cpp-python is not installed ({INSTALL_HINT}; it builds llama.cpp from "
                              f"source): {exc}") from None
    return getattr(llama_cpp, "__version__", "unknown")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specserve" / "gguf"


def _digest(paths: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def checkpoint_hash(model_dir: Path) -> str:
    """sha256 over the names and contents of the checkpoint's files (the converter reads only those)."""
    return _digest(sorted(p for p in model_dir.iterdir() if p.is_file()), model_dir)


def converter_hash(tree: Path) -> str:
    """sha256 over the converter's Python sources (script, conversion package, gguf-py): its version."""
    files = [tree / CONVERTER]
    for sub in ("conversion", "gguf-py/gguf"):
        files += sorted(p for p in (tree / sub).rglob("*.py"))
    return _digest(files, tree)


def convert(model_dir: Path, tree: Path, gguf_type: str, cache_dir: Path | None = None, *, log=None) -> Path:
    """The GGUF file of `model_dir` at `gguf_type` (f32 | f16 | q8_0 | q4_0), converted once and cached.

    The cache key is the checkpoint's content hash, the converter's hash and RECIPE_VERSION. Raises
    ValueError with the converter's last error line when the conversion fails.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{str(model_dir)!r} is not a model directory (no config.json)")
    key = f"{checkpoint_hash(model_dir)[:16]}-{converter_hash(tree)[:12]}-r{RECIPE_VERSION}"
    out_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = out_dir / key / f"model-{gguf_type}.gguf"
    if out.is_file():
        return out
    if gguf_type == "q4_0":  # made by the installed llama.cpp's quantizer: its version names the folder
        out = out.parent / f"llama-cpp-python-{require_llama_cpp()}" / out.name
        if out.is_file():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        return _quantize_q4_0(convert(model_dir, tree, "f32", cache_dir, log=log), out, log=log)
    out.parent.mkdir(parents=True, exist_ok=True)
    if log is not None:
        log(f"llama.cpp: converting {model_dir} to GGUF {gguf_type} with {tree / CONVERTER} (once; cached in {out.parent})")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        source = model_dir
        if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
            source = _stage_with_standin_tokenizer(model_dir, Path(tmp) / "model")
        partial = Path(tmp) / out.name
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "specserve.evals.llamacpp_peer", str(tree), str(source), str(partial), gguf_type],
            capture_output=True, text=True,
        )
        if proc.returncode != 0 or not partial.is_file():
            lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit status {proc.returncode}"
            raise ValueError(f"llama.cpp's converter failed on {str(model_dir)!r}: {why}")
        os.replace(partial, out)  # whole files only in the cache: an interrupted run leaves nothing behind
    if log is not None:
        log(f"llama.cpp: converted in {time.perf_counter() - t0:.1f}s: {out}")
    return out


def _quantize_q4_0(f32: Path, out: Path, *, log=None) -> Path:
    """llama.cpp's quantizer (llama_model_quantize) on the f32 GGUF: every weight q4_0, the LM head included
    ("pure": by default llama.cpp keeps the LM head at 6 bits, ours is 4); the token embedding too, which a
    tied model's LM head reads (ours keeps its embedding float32, only ever indexed). In a child process, as
    the converter: llama.cpp aborts the process on some inputs (a row length that is no multiple of 32)."""
    if log is not None:
        log(f"llama.cpp: quantizing {f32} to q4_0 with llama_model_quantize (once; cached)")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        proc = subprocess.run([sys.executable, "-m", "specserve.evals.llamacpp_peer", "--quantize-q4_0", str(f32),
                               str(partial)], capture_output=True, text=True)
        if proc.returncode != 0 or not partial.is_file():
            lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit status {proc.returncode}"
            raise ValueError(f"llama.cpp's quantizer failed on {str(f32)!r}: {why}")
        os.replace(partial, out)
    return out


def _run_quantizer(f32: str, outfile: str) -> None:
    """`_quantize_q4_0`'s child: llama_model_quantize, in this process."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.pure = True
    status = llama_cpp.llama_model_quantize(f32.encode(), outfile.encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"llama_model_quantize returned {status}")


def _stage_with_standin_tokenizer(model_dir: Path, staged: Path) -> Path:
    """The checkpoint's files linked into `staged`, plus a stand-in byte-level BPE tokenizer.

    llama.cpp's converter writes a vocabulary into every GGUF file and refuses a checkpoint without
    a tokenizer (bench decode's random Llama has none). We hand llama.cpp token ids, so the vocabulary
    is never used; the converter pads one smaller than the model's vocab_size with unused entries.
    """
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = json.loads((model_dir / "config.json").read_text()).get("vocab_size") or 0
    want = 320  # 256 bytes and a few merges (llama.cpp's loader requires merges for a BPE vocabulary)
    if vocab_size < want:
        raise ValueError(f"{str(model_dir)!r} has no tokenizer, which llama.cpp's converter needs, and its vocabulary "
                         f"({vocab_size}) is too small for a stand-in byte-level one (>= {want})")
    staged.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.is_file():
            (staged / path.name).symlink_to(path.resolve())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=want, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = " ".join(f"{a}{b}{c}" for a in "etaoinshr" for b in "etaoinshr" for c in "dlucm")
    tok.train_from_iterator([text] * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(staged))
    return staged


@contextlib.contextmanager
def _model_params(**fields):
    """llama-cpp-python's `Llama` with these fields of llama.cpp's model parameters (its constructor does not
    take them all: it starts from `llama_model_default_params`, patched here while it runs)."""
    from llama_cpp import llama as llama_module

    bindings = llama_module.llama_cpp  # the module `Llama.__init__` reads the defaults from
    default = bindings.llama_model_default_params

    def patched():
        params = default()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    bindings.llama_model_default_params = patched
    try:
        yield
    finally:
        bindings.llama_model_default_params = default


@functools.lru_cache(maxsize=None)
def _extra_buffers_run(gguf: Path) -> bool:
    """Whether llama.cpp decodes a 2-token batch of `gguf` with its extra weight buffers (repacked / AMX layouts),
    tried in a child process: a llama-cpp-python 0.3.36 built natively on an AMX Xeon crashed (SIGSEGV) on every
    batch of 2 or more tokens with them and ran without them. Without them llama.cpp runs its plain CPU kernels."""
    code = ("import sys, llama_cpp; llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False); "
            "llm.eval([1, 2])")
    proc = subprocess.run([sys.executable, "-c", code, str(gguf)], capture_output=True, text=True)
    if proc.returncode != 0:
        log.warning("llama.cpp's extra weight buffers (repacked / AMX layouts) crashed a 2-token batch of %s "
                    "(exit status %s): the peer runs without them", gguf.name, proc.returncode)
    return proc.returncode == 0


@dataclass
class LlamaCpp:
    """A GGUF model loaded in llama-cpp-python with a fixed thread count.

    `n_threads` and `n_threads_batch` are both `threads`, so prompt processing and decoding use the
    same cores specserve's kernels do. The KV cache is f32 (llama.cpp's default is f16) because ours
    is fp32 on the CPU kernels' path at every weight dtype, f16 against ours with `kv_cache_dtype="float16"`
    (`load`'s kv_type): the pairings differ in weights only.
    """

    gguf: Path
    threads: int
    n_ctx: int
    gpu: bool = False

    @property
    def gguf_type(self) -> str:
        """The converted file's type ("q8_0", ...), or a user's GGUF file's name."""
        return self.gguf.stem.removeprefix("model-") if self.gguf.stem.startswith("model-") else self.gguf.name

    kv_type: str = "f32"
    logits_all: bool = False  # every row's logits, as a verify forward needs (`bench verify`)
    # > 0: llama.cpp's own speculative decoding with prompt lookup (llama-cpp-python's LlamaPromptLookupDecoding,
    # drafting this many tokens a step): the peer of our n-gram drafter.
    prompt_lookup: int = 0

    def __post_init__(self) -> None:
        import llama_cpp

        kv = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[self.kv_type]
        # llama.cpp's extra weight buffers (its repacked and AMX layouts) unless they crash this host (`_extra_buffers_run`)
        extra_buffers = self.gpu or _extra_buffers_run(self.gguf)
        # Prompt lookup evaluates a step's draft (up to prompt_lookup tokens after the sampled one) past the answer's
        # last token. llama-cpp-python keeps drafts within llama.cpp's context, which llama.cpp pads (to 256), but
        # its buffer of token ids holds the n_ctx asked for: an answer ending near an unpadded n_ctx overflowed it
        # ("could not broadcast ... (11,) into ... (10,)"). Room for one draft past the answer keeps them apart.
        context = self.n_ctx + (self.prompt_lookup + 1 if self.prompt_lookup else 0)
        try:
            with _model_params(use_extra_bufts=extra_buffers):
                self.llm = llama_cpp.Llama(model_path=str(self.gguf), n_ctx=context, n_batch=min(context, 512),
                                           n_threads=self.threads, n_threads_batch=self.threads, type_k=kv, type_v=kv,
                                           n_gpu_layers=-1 if self.gpu else 0, logits_all=self.logits_all,
                                           draft_model=self._draft_model(), verbose=False)
        except Exception as exc:  # a GGUF this llama.cpp cannot read: usually a converter newer than the library
            raise ValueError(f"llama-cpp-python cannot load {self.gguf} ({exc}); use the converter from the "
                             "same llama.cpp version as the installed llama-cpp-python") from exc

    def _draft_model(self):
        if not self.prompt_lookup:
            return None
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        return LlamaPromptLookupDecoding(num_pred_tokens=self.prompt_lookup)

    def generate(self, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
        """Exactly `max_tokens` tokens after `prompt` (EOS does not stop generation, as with ignore_eos).

        Greedy at temperature 0; otherwise plain sampling at `temperature` (top-k, top-p, min-p off).
        """
        if len(prompt) + max_tokens > self.n_ctx:
            raise ValueError(f"{len(prompt)} prompt + {max_tokens} new tokens exceed llama.cpp's context ({self.n_ctx})")
        # reset() forgets the previous sequence, so llama-cpp-python's prompt-prefix reuse cannot skip
        # prompt processing on a repeated prompt: every run does the work specserve's run does.
        self.llm.reset()
        if temperature > 0:
            self.llm.set_seed(seed)
            sample = {"temp": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
        else:
            sample = {"temp": 0.0, "top_k": 1}
        out: list[int] = []
        for token in self.llm.generate(prompt, repeat_penalty=1.0, reset=True, **sample):
            out.append(int(token))
            if len(out) == max_tokens:
                break
        return out

    def verify_seconds(self, prefix: list[int], rows: list[int]) -> float:
        """Seconds of one `llama_decode` of `rows` (a chain: causal, every row's logits when `logits_all`) after
        `prefix`, whose KV is computed once and kept: rewinding to the prefix drops only the rows' KV."""
        if self.llm.n_tokens < len(prefix) or list(self.llm.input_ids[:len(prefix)]) != list(prefix):
            self.llm.reset()
            self.llm.eval(prefix)
        self.llm.n_tokens = len(prefix)  # eval() removes the KV past n_tokens before it decodes
        t0 = time.perf_counter()
        self.llm.eval(rows)
        return time.perf_counter() - t0

    def timed(self, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0) -> tuple[float, list[int]]:
        """(seconds, tokens) of one `generate`, prompt processing included."""
        t0 = time.perf_counter()
        out = self.generate(prompt, max_tokens, temperature, seed)
        return time.perf_counter() - t0, out


def locate(source: str | None, model: str | Path | None = None) -> Path | PeerUnavailable:
    """llama.cpp's source tree, or the reason the peer is skipped (llama-cpp-python or the converter
    missing); a source given that is not a converter tree raises ValueError. Cheap: callers run it
    before loading anything, so bad input fails at once. A GGUF target (`model`) needs no converter: llama.cpp
    runs the same file (the tree returned is then Path() and unused)."""
    from specserve.loading import MODEL_ENV_VAR
    from specserve.loading.gguf_file import is_gguf

    named = model if model is not None else os.environ.get(MODEL_ENV_VAR)  # what runs when no --model is given
    problems = []
    tree = Path()
    if named is not None and not is_gguf(named):  # no name at all: the default model, a GGUF file
        try:
            tree = find_converter(source)  # a source given that is not a converter tree: ValueError, even here
        except PeerUnavailable as reason:
            problems.append(str(reason))
    try:
        require_llama_cpp()
    except PeerUnavailable as reason:
        problems.append(str(reason))
    return PeerUnavailable("; ".join(problems)) if problems else tree


def load(model_dir: str | Path, tree: Path, *, dtype, threads: int, n_ctx: int, gpu: bool = False,
         cache_dir: str | Path | None = None, log=None, logits_all: bool = False, prompt_lookup: int = 0,
         kv_type: str = "f32") -> LlamaCpp:
    """`model_dir` converted (cached) to the GGUF type that pairs with our `dtype` (or "int8" / "int4": our
    quantized storages), loaded; a GGUF file is loaded as it is — the same file both sides, whatever `dtype`.
    kv_type: llama.cpp's KV cache, "f32" or "f16" (pair it with our `kv_cache_dtype`)."""
    from specserve.loading.gguf_file import is_gguf

    options = dict(logits_all=logits_all, prompt_lookup=prompt_lookup, kv_type=kv_type)
    if is_gguf(model_dir):
        return LlamaCpp(Path(model_dir), threads, n_ctx, gpu, **options)
    name = str(dtype).removeprefix("torch.")
    if name not in GGUF_TYPE:
        raise ValueError(f"no GGUF type pairs with dtype {name!r}; known: {', '.join(GGUF_TYPE)}")
    gguf = convert(Path(model_dir), tree, GGUF_TYPE[name], Path(cache_dir) if cache_dir else None, log=log)
    return LlamaCpp(gguf, threads, n_ctx, gpu, **options)


# -- the converter subprocess ----------------------------------------------------------------------

def _run_converter(tree: str, model_dir: str, outfile: str, gguf_type: str) -> None:
    """Run llama.cpp's converter, unchanged but for one fallback, in this (child) process."""
    import importlib.util

    sys.path[:0] = [tree, str(Path(tree) / "gguf-py")]
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", Path(tree) / CONVERTER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # defines the model classes; main() runs below

    # The converter names the BPE pre-tokenizer (the regex that splits text before BPE) by hashing
    # how the tokenizer encodes a test string, and refuses tokenizers whose hash it does not list, as
    # our own trained tokenizers' are. llama.cpp's tokenizer is never used here (we pass it token
    # ids our tokenizer made), so an unknown pre-tokenizer falls back to the plain "gpt-2" one
    # instead of stopping the conversion. Recent versions keep the class in conversion.base, older
    # ones in the script itself (TextModel, before that Model).
    owners = [sys.modules.get("conversion.base"), module]
    cls = next((getattr(m, name) for m in owners if m is not None for name in ("TextModel", "Model")
                if "get_vocab_base_pre" in getattr(getattr(m, name, None), "__dict__", {})), None)
    if cls is None:
        raise SystemExit(f"{CONVERTER} in {tree} has no get_vocab_base_pre to extend: an unsupported converter version")
    original = cls.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    cls.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(Path(tree) / CONVERTER), model_dir, "--outfile", outfile, "--outtype", gguf_type]
    module.main()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--quantize-q4_0":
        _run_quantizer(*sys.argv[2:])
    elif len(sys.argv) == 5:
        _run_converter(*sys.argv[1:])
    else:
        raise SystemExit("usage: python -m specserve.evals.llamacpp_peer LLAMA_CPP_TREE MODEL_DIR OUTFILE f32|f16|q8_0\n"
                         "       python -m specserve.evals.llamacpp_peer --quantize-q4_0 F32_GGUF OUTFILE")
