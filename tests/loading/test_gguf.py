"""GGUF files (llama.cpp's format) as targets: a tiny Llama written with the `gguf` package's GGUFWriter
(tests/loading/gguf_writer.py: llama.cpp's metadata, the converter's q / k row permutation) in every weight type
specserve reads, checked against references that do not go through specserve.loading.

- F32, F16, BF16: our logits (torch path and CPU kernels) equal transformers' own GGUF loading of the same file.
- Q8_0, Q4_0, Q4_1 and the K-quant Q6_K: the torch path's logits equal a float64 transformers model whose weights
  are the file's raw bytes decoded here with llama.cpp's formulas (ggml-quants.c dequantize_row_*); the kernels'
  path (Q8_0 / Q4_0 / Q4_1 run as stored) within the 8-bit activations' bound of it; and one packed product of the
  loaded model bitwise equal to an exact emulation of the kernels' arithmetic on the file's blocks.
- the rope permutation undone (`rope_rows` against the converter's definition; q and k load as the HF directory's);
- the tokenizer and chat template (against transformers' GGUF tokenizer and the original one), EOS ids from the
  metadata, the per-file cache (index and tokenizer) read on the second open;
- greedy speculation on a GGUF target equal to plain decoding; the load line of a K-quant file;
- bad files (another architecture, an unread weight type, truncated, corrupt, not GGUF) refused by the CLI in one
  line with exit status 2.

Tolerance "within float32 rounding": max |ours - reference| <= 3e-5 * max |reference| over every logit of the
prompt. 3e-5 ~ gamma_512 = 512 u (u = 2^-24), the worst-case relative forward error of one float32 dot product of
the longest length here (512 inputs of the down projection), which any summation order stays within; the logits
pass through 7 products per layer and 2 layers, but RMS norms rescale after each and typical errors are ~sqrt(n) u,
so the measured gap is 2-3e-6 relative (the torch path against transformers: 0, the same torch operations). A
weight decoded wrongly (scale, offset, nibble order, row permutation, tied head) is off by O(1).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.kv_cache import BlockAllocator
from specserve.loading.gguf_blocks import rope_rows
from specserve.loading.gguf_file import GGUFFile
from specserve.model import LlamaModel
from specserve.step_batch import StepBatchBuilder

from loading.gguf_writer import CHAT_TEMPLATE, permute_rows, write_gguf

CPU = torch.device("cpu")
REL_F32 = 3e-5  # "within float32 rounding": see the module docstring
KERNEL_BOUND = 0.06  # the 8-bit activations' share, as tests/compute_kernels/test_quantization.py bounds it (3.0-3.3 % here)
PROMPT = list(range(3, 40)) + [7, 7, 7, 250, 299, 0]
HEADS, KV_HEADS, HIDDEN = 4, 2, 256

# name -> write_gguf arguments. Tied (no output.weight): F16, Q4_0, Q6_K; the others untied.
FILES = {
    "F32": dict(weight_type="F32"),
    "F16": dict(weight_type="F16", tied=True),
    "BF16": dict(weight_type="BF16"),
    "Q8_0": dict(weight_type="Q8_0"),
    "Q4_0": dict(weight_type="Q4_0", tied=True),
    "Q4_1": dict(weight_type="Q4_1"),
    "Q6_K": dict(weight_type="Q6_K", tied=True),
    # One product group in two formats (q, k Q4_0 and v Q8_0): the kernels run that fused q|k|v from float weights.
    "Q4_0+Q8_0": dict(weight_type="Q4_0", overrides={"blk.0.attn_v.weight": "Q8_0"}),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """The source: a 2-layer GQA Llama, hidden 256 (a whole Q6_K block per row), non-default rope theta and eps."""
    from tiny_models import build_model

    return build_model(tmp_path_factory.mktemp("hf"), "llama", hidden_size=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                       init_std=0.1, rope_theta=5000.0, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def gguf_path(hf_dir, tmp_path_factory):
    """gguf_path(name) -> a GGUF file of `FILES[name]` written from `hf_dir` (once; each in a directory of its own, as
    a user's download sits, with no config.json beside it)."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            (root / name).mkdir()
            made[name] = write_gguf(hf_dir, root / name / f"tiny-{name}.gguf", **FILES[name])
        return made[name]

    return get


def _logits(model: LlamaModel, prompt=PROMPT) -> torch.Tensor:
    """float64[len(prompt), vocab]: every position's logits from one prefill (as tests/compute_kernels/test_quantization.py)."""
    allocator = BlockAllocator(len(prompt) // 4 + 2, 4)
    allocator.allocate("s", len(prompt))
    builder = StepBatchBuilder(allocator)
    builder.add("s", 0, np.asarray(prompt), logits="all")
    return model.forward(builder.build(), model.new_cache(allocator)).logits.double()


def _assert_f32_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    gap, scale = float((got - ref).abs().max()), float(ref.abs().max())
    assert gap <= REL_F32 * scale, f"{what}: max |gap| {gap:.3g} > {REL_F32} * {scale:.3g}"


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


# ---- decoding a file's bytes, here, from llama.cpp's definitions (not specserve.loading) -----------------------------

def _raw_tensors(path: Path) -> dict[str, tuple[str, tuple[int, int], np.ndarray]]:
    """GGUF name -> (GGML type name, torch-order shape, the tensor's bytes uint8[rows, row bytes])."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        shape = tuple(int(n) for n in reversed([int(x) for x in t.shape]))
        raw = np.ascontiguousarray(np.asarray(t.data)).view(np.uint8).reshape(shape[0], -1)
        out[t.name] = (t.tensor_type.name, shape, raw)
    return out


def _half(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float64)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """qs uint8[..., 16] -> a Q4 block's 32 values: byte k's low nibble is input k, its high nibble input k + 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)


def blocks_of(type_name: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q int64[rows, in], d float64[rows, runs], m float64[rows, runs] or None) of Q8_0 / Q4_0 / Q4_1 bytes, q as the
    weight's integer factor: Q8_0 w = q·d, Q4_0 w = q·d with q = nibble - 8, Q4_1 w = q·d + m (ggml-common.h)."""
    rows = raw.shape[0]
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[type_name]
    b = raw.reshape(rows, -1, size)
    if type_name == "Q8_0":
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.int64)
        return q.reshape(rows, -1), _half(b, 0), None
    if type_name == "Q4_0":
        return (_nibbles(b[..., 2:]) - 8).reshape(rows, -1), _half(b, 0), None
    return _nibbles(b[..., 4:]).reshape(rows, -1), _half(b, 0), _half(b, 2)


def dequantize_q6_k(raw: np.ndarray) -> np.ndarray:
    """ggml-quants.c dequantize_row_q6_K (block_q6_K: ql[128], qh[64], int8 scales[16], float16 d; 256 inputs), in
    float64: per half n of the block and l < 32, is = l / 16,
    y[l] = d·sc[is]·q1, y[l+32] = d·sc[is+2]·q2, y[l+64] = d·sc[is+4]·q3, y[l+96] = d·sc[is+6]·q4 with
    q1 = (ql[l] & 0xF | ((qh[l] >> 0) & 3) << 4) - 32, q2 = (ql[l+32] & 0xF | ((qh[l] >> 2) & 3) << 4) - 32,
    q3 = (ql[l] >> 4 | ((qh[l] >> 4) & 3) << 4) - 32, q4 = (ql[l+32] >> 4 | ((qh[l] >> 6) & 3) << 4) - 32."""
    rows = raw.shape[0]
    b = raw.reshape(-1, 210)
    ql, qh = b[:, :128].astype(np.int64), b[:, 128:192].astype(np.int64)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float64)
    d = _half(b, 208)[:, None]
    y = np.empty((b.shape[0], 256))
    for n in range(2):
        lo, hi, s = ql[:, 64 * n:64 * n + 64], qh[:, 32 * n:32 * n + 32], sc[:, 8 * n:8 * n + 8]
        for l in range(32):
            i = l // 16
            q1 = ((lo[:, l] & 0xF) | (((hi[:, l] >> 0) & 3) << 4)) - 32
            q2 = ((lo[:, l + 32] & 0xF) | (((hi[:, l] >> 2) & 3) << 4)) - 32
            q3 = ((lo[:, l] >> 4) | (((hi[:, l] >> 4) & 3) << 4)) - 32
            q4 = ((lo[:, l + 32] >> 4) | (((hi[:, l] >> 6) & 3) << 4)) - 32
            base = 128 * n + l
            y[:, base] = d[:, 0] * s[:, i] * q1
            y[:, base + 32] = d[:, 0] * s[:, i + 2] * q2
            y[:, base + 64] = d[:, 0] * s[:, i + 4] * q3
            y[:, base + 96] = d[:, 0] * s[:, i + 6] * q4
    return y.reshape(rows, -1)


def decode(type_name: str, shape: tuple[int, ...], raw: np.ndarray) -> np.ndarray:
    """A tensor's bytes as float64 of `shape`, by llama.cpp's formulas (float types exactly)."""
    flat = raw.reshape(-1)
    if type_name == "F32":
        return flat.view(np.float32).astype(np.float64).reshape(shape)
    if type_name == "F16":
        return flat.view(np.float16).astype(np.float64).reshape(shape)
    if type_name == "BF16":
        return (flat.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64).reshape(shape)
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):
        q, d, m = blocks_of(type_name, raw)
        w = q * np.repeat(d, 32, axis=1)
        return w + np.repeat(m, 32, axis=1) if m is not None else w
    if type_name == "Q6_K":
        return dequantize_q6_k(raw)
    raise AssertionError(f"the test does not decode {type_name}")


def hf_rows(gguf_rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the converter's permutation from its definition: GGUF row i is Hugging Face row perm[i]."""
    perm = permute_rows(np.arange(gguf_rows.shape[0])[:, None], n_head)[:, 0]
    out = np.empty_like(gguf_rows)
    out[perm] = gguf_rows
    return out


_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}


def reference_state(path: Path) -> dict[str, torch.Tensor]:
    """The file's weights under Hugging Face names, float64, decoded and un-permuted here."""
    globals_ = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
    state = {}
    for name, (type_name, shape, raw) in _raw_tensors(path).items():
        w = decode(type_name, shape, raw)
        if name.endswith("attn_q.weight"):
            w = hf_rows(w, HEADS)
        elif name.endswith("attn_k.weight"):
            w = hf_rows(w, KV_HEADS)
        if name in globals_:
            hf = globals_[name]
        else:
            _, layer, rest = name.split(".", 2)
            hf = f"model.layers.{layer}.{_LAYER[rest]}"
        state[hf] = torch.from_numpy(w)
    return state


def reference_logits(hf_dir: Path, path: Path) -> torch.Tensor:
    """float64 logits of transformers' Llama (eager attention, float64 throughout) holding `reference_state(path)`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    state = reference_state(path)
    tied = "lm_head.weight" not in state
    config = LlamaConfig.from_pretrained(str(hf_dir), tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    model.config._attn_implementation = "eager"
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and (tied or not missing), (missing, unexpected)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].double()


# ---- float types: transformers' own GGUF loading ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_files_match_transformers_gguf_loading(gguf_path, name):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    path = gguf_path(name)
    ref_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    assert ref_model.config.tie_word_embeddings == (name == "F16")
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].double()
    torch_path = LlamaModel.from_pretrained(path, CPU, torch.float32, cpu_kernels=False)
    assert torch_path.kernels is None
    _assert_f32_close(_logits(torch_path), ref, f"{name} torch path")
    # The kernels (float32 storage: see test_half_size_files_keep_their_float32_norms for the default's).
    llm = LLM(path, drafter=None, device="cpu", dtype="float32")
    assert llm.model.kernels is not None
    _assert_f32_close(_logits(llm.model), ref, f"{name} kernels")


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_half_size_files_keep_their_float32_norms(gguf_path, name):
    path = gguf_path(name)
    exact = _logits(LlamaModel.from_pretrained(path, CPU, torch.float32, cpu_kernels=True))
    llm = LLM(path, drafter=None, device="cpu")  # the default dtype: the file's half-size storage, on the kernels
    assert llm.model.kernels is not None
    _assert_f32_close(_logits(llm.model), exact, f"{name} file at the default dtype ({llm.dtype})")


def test_the_rope_permutation_is_undone(gguf_path, hf_dir):
    # rope_rows inverts the converter's permutation (written in gguf_writer from its definition) ...
    for rows, heads in ((256, 4), (128, 2), (64, 1), (24, 3), (512, 8)):
        permuted = permute_rows(np.arange(rows)[:, None], heads)[:, 0]
        if rows // heads > 2:
            assert (permuted != np.arange(rows)).any()
        np.testing.assert_array_equal(permuted[rope_rows(rows, heads).numpy()], np.arange(rows),
                                      err_msg=f"{rows} rows, {heads} heads")
    # ... so an F32 file's q and k load as the Hugging Face directory holds them, bit for bit (transformers, which
    # undoes it too, agrees on the logits: test_float_files_match_transformers_gguf_loading).
    from safetensors.torch import load_file

    original = load_file(str(hf_dir / "model.safetensors"))
    state, blocks = GGUFFile(gguf_path("F32")).load(torch.float32)
    assert not blocks
    for layer in (0, 1):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            key = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert torch.equal(state[key], original[key]), key


# ---- quantized types: a float64 reference from the file's bytes ------------------------------------------------------

@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q6_K"])
def test_quantized_files_match_a_float64_reference_of_llama_cpp_dequantization(gguf_path, hf_dir, name):
    path = gguf_path(name)
    ref = reference_logits(hf_dir, path)
    torch_path = LlamaModel.from_pretrained(path, CPU, torch.float32, cpu_kernels=False)
    _assert_f32_close(_logits(torch_path), ref, f"{name} torch path")
    llm = LLM(path, drafter=None, device="cpu")
    kernels = llm.model.kernels
    got = _logits(llm.model)
    storages = {p.storage for layer in kernels.layers for p in layer.products()} | {kernels.lm_head.storage}
    if name == "Q6_K":  # widened to float32 at load: the kernels multiply float32 weights
        assert storages == {"float32"}
        _assert_f32_close(got, ref, f"{name} kernels")
    else:  # run as stored; what is left is the 8-bit activations' error
        assert storages == {{"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "q4_1"}[name]}
        gap = _relative(got, ref)
        assert 1e-4 < gap < KERNEL_BOUND, (name, gap)


def test_a_product_group_in_two_formats_runs_from_float_weights(gguf_path, hf_dir):
    path = gguf_path("Q4_0+Q8_0")
    ref = reference_logits(hf_dir, path)
    model = LLM(path, drafter=None, device="cpu").model
    kernels = model.kernels
    assert kernels.layers[0].qkv.storage == "float32"  # q, k Q4_0 + v Q8_0: fused from float weights
    assert kernels.layers[1].qkv.storage == "int4" and kernels.layers[0].gate_up.storage == "int4"
    gap = _relative(_logits(model), ref)
    assert 1e-4 < gap < KERNEL_BOUND, gap


def _emulate_blocks(x: np.ndarray, q: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """The kernels' int8 / int4 arithmetic on blocks (q int64 signed: Q8_0 q, Q4_0 nibble - 8; d float16), exactly:
    x quantized per run of 32 by quantize_row_q8_0_ref (float32 scales), S_j = Σ q·qx (exact), then per element
    acc = fma(S_j, round_f32(d_j·dx_j), acc) over the runs in order from 0, + 0 (no bias)."""
    from fractions import Fraction

    from compute_kernels.test_linear import round_f32
    from quant_reference import q8_0_reference

    qx, dx = q8_0_reference(x, np.float32)
    out = np.empty((x.shape[0], q.shape[0]), dtype=np.float32)
    for r in range(x.shape[0]):
        for o in range(q.shape[0]):
            acc = Fraction(0)
            for j in range(d16.shape[1]):
                s = int(np.dot(q[o, 32 * j:32 * j + 32], qx[r, 32 * j:32 * j + 32].astype(np.int64)))
                acc = round_f32(s * round_f32(Fraction(float(d16[o, j])) * Fraction(float(dx[r, j]))) + acc)
            out[r, o] = float(round_f32(acc + 0))
    return out


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_packed_gguf_product_is_bitwise_the_kernel_arithmetic_on_the_files_blocks(gguf_path, name):
    from compute_kernels.test_linear import emulate_q4_1
    from specserve.kernels import linear_rows

    path = gguf_path(name)
    model = LlamaModel.from_pretrained(path, CPU, torch.float32, cpu_kernels=True)
    qkv = model.kernels.layers[0].qkv  # q | k | v of layer 0: the rows of two permuted matrices and one plain
    raw = _raw_tensors(path)
    parts = []
    for proj, heads in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", None)):
        type_name, _, data = raw[f"blk.0.{proj}.weight"]
        assert type_name == name
        q, d, m = blocks_of(type_name, data)
        if heads is not None:  # row permutation moves whole rows: blocks and all
            q, d = hf_rows(q, heads), hf_rows(d, heads)
            m = hf_rows(m, heads) if m is not None else None
        parts.append((q, d, m))
    q = np.concatenate([p[0] for p in parts])
    d16 = np.concatenate([p[1] for p in parts]).astype(np.float16)  # exact: they were float16
    m16 = np.concatenate([p[2] for p in parts]).astype(np.float16) if name == "Q4_1" else None
    assert qkv.out_features == q.shape[0] == 512 and qkv.in_features == HIDDEN

    x = np.random.default_rng(3).standard_normal((2, HIDDEN)).astype(np.float32)
    out = np.full((2, qkv.out_features), np.nan, dtype=np.float32)
    linear_rows(x, qkv.weight, qkv.scales, qkv.bias, out, False)
    rows = np.array([0, 1, 2, 31, 32, 33, 63, 64, 127, 200, 255, 256, 257, 287, 288, 319, 320, 383, 384, 385, 447, 511])
    if name == "Q4_1":
        expected = emulate_q4_1(x, q[rows].astype(np.uint8), d16[rows], m16[rows], np.zeros(len(rows), np.float32))
    else:
        expected = _emulate_blocks(x, q[rows], d16[rows])
    np.testing.assert_array_equal(out[:, rows].view(np.uint32), expected.view(np.uint32))


# ---- tokenizer, chat template, EOS, the cache ------------------------------------------------------------------------

TEXTS = ["def f(x):\n    return x + 1\n", "The quick brown fox. Ünïcödé ✓ 日本語 🙂",
         "<|endoftext|>import os<|endoftext|>\n", "  two  spaces\tand a tab\r\n", "class Point:\n    pass", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "print(1 + 1)  # ✓"},
            {"role": "assistant", "content": "2"}, {"role": "user", "content": "日本語?"}]


def test_tokenizer_chat_template_and_eos_come_from_the_file_and_are_cached(hf_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from specserve.loading.user_cache import cache_dir

    path = write_gguf(hf_dir, tmp_path / "tok.gguf", "Q4_1")  # a file never opened before
    original = AutoTokenizer.from_pretrained(str(hf_dir))
    original.chat_template = CHAT_TEMPLATE
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    first = GGUFFile(path)
    assert first.tokenizer_dir() is None  # indexed now; the tokenizer is converted on first use
    ours = first.tokenizer()
    for tok, who in ((theirs, "transformers' GGUF tokenizer"), (original, "the original tokenizer")):
        for text in TEXTS:
            assert ours.encode(text) == tok.encode(text), (who, text)
        for generation_prompt in (True, False):
            rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
            assert rendered == tok.apply_chat_template(MESSAGES, tokenize=False,
                                                       add_generation_prompt=generation_prompt), who
    assert "<|im_start|>assistant\n" in ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    eos = original.convert_tokens_to_ids("<|endoftext|>")
    assert ours.encode("<|endoftext|>") == [eos]
    assert first.eos_token_ids(ours) == (eos,)

    # What the first open left in the cache: the index and the converted tokenizer, under the user's cache dir.
    assert first.cache.parent == cache_dir() / "gguf"
    files = {p.relative_to(first.cache).as_posix() for p in first.cache.rglob("*") if p.is_file()}
    assert "index.json" in files and "tokenizer/tokenizer.json" in files, files
    assert not any(f.endswith(".tmp") for f in files), files
    index = json.loads((first.cache / "index.json").read_text())
    assert index["metadata"]["general.architecture"] == "llama" and "blk.0.attn_q.weight" in index["tensors"]

    # The second open reads only those: neither the gguf reader nor transformers' GGUF tokenizer conversion runs.
    import gguf
    import transformers.integrations.gguf as tf_gguf

    def refuse(*args, **kwargs):
        raise AssertionError("the second open re-read the file")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(tf_gguf, "get_gguf_tokenizer", refuse)
    second = GGUFFile(path)
    assert second.cache == first.cache and second.metadata == first.metadata and second.tensors == first.tensors
    again = second.tokenizer()
    assert second.tokenizer_dir() == first.cache / "tokenizer"
    assert [again.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    assert again.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert second.eos_token_ids(again) == (eos,)
    assert second.config.vocab_size == 300 and second.config.num_kv_heads == KV_HEADS


def test_eos_ids_are_the_metadatas(hf_dir, tmp_path):
    # End-of-turn from the metadata too (llama.cpp stops on it): a token that is nothing special to the tokenizer.
    path = write_gguf(hf_dir, tmp_path / "eot.gguf", "F32", eot_token="def")
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(str(hf_dir))
    eos, eot = original.convert_tokens_to_ids("<|endoftext|>"), original.convert_tokens_to_ids("def")
    assert eot not in (eos, None)
    assert GGUFFile(path).eos_token_ids() == (eos, eot)


# ---- speculation on a GGUF target ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["Q4_1", "F16"])
def test_greedy_speculation_equals_plain_decoding_on_a_gguf_target(gguf_path, name):
    path = gguf_path(name)
    prompts = ["def f(x):\n    return x + 1\n" * 2, "class Point:\n    def __init__(self, x, y):",
               "for i in range(10):",
               "import os\nimport sys\nprint(os.path.join('a', 'b'))\n"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(path, drafter=None, device="cpu").generate(prompts, params)]
    outs = LLM(path, drafter="ngram", speculation="static", device="cpu").generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.spec.num_drafted for o in outs) > 0


def test_the_load_line_says_the_k_quant_was_dequantized(gguf_path, hf_dir, tmp_path):
    llm = LLM(gguf_path("Q6_K"), drafter=None, device="cpu")
    assert llm.checkpoint.weight_types() == {"Q6_K": 15}  # 2 layers x 7 matrices + the (tied) embedding
    assert llm.checkpoint.describe() == "GGUF 15 Q6_K dequantized at load"
    # As llama.cpp's K-quant files mix types: what runs as stored and what was widened, each counted.
    mixed = write_gguf(hf_dir, tmp_path / "mixed.gguf", "Q6_K", tied=True,
                       overrides={"token_embd.weight": "Q8_0", "blk.0.attn_v.weight": "F16"})
    assert GGUFFile(mixed).describe() == "GGUF 1 F16, 1 Q8_0 as stored; 13 Q6_K dequantized at load"


# ---- refusals through the CLI: one line, exit 2 ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def bad_files(hf_dir, gguf_path, tmp_path_factory) -> dict[str, Path]:
    """A file of each kind of bad GGUF: name -> path."""
    root = tmp_path_factory.mktemp("bad")
    good = gguf_path("F32").read_bytes()
    files = {
        "architecture": write_gguf(hf_dir, root / "gpt2-arch.gguf", "F32", architecture="gpt2"),
        "weight type": write_gguf(hf_dir, root / "f64.gguf", "F32", overrides={"blk.1.ffn_up.weight": "F64"}),
        "truncated": root / "half.gguf",
        "corrupt": root / "corrupt.gguf",
        "not gguf": root / "not-gguf.gguf",
    }
    files["truncated"].write_bytes(good[:len(good) // 2])
    files["corrupt"].write_bytes(b"GGUF" + np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    files["not gguf"].write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    return files


@pytest.mark.parametrize("case, words", [
    ("architecture", ["architecture", "'gpt2'", "not supported"]),
    ("weight type", ["blk.1.ffn_up.weight", "F64"]),
    ("truncated", ["half.gguf", "truncated"]),
    ("corrupt", ["corrupt.gguf", "corrupt"]),
    ("not gguf", ["not-gguf.gguf", "not a GGUF file"]),
])
def test_bad_files_are_refused_in_one_line(capsys, bad_files, case, words):
    """`specserve generate --model BAD.gguf` (through the CLI's main(); tests/test_startup_refusals.py checks that a
    real process prints only that line)."""
    from cli_runner import cli

    res = cli(capsys, "generate", "--prompt", "x", "--raw", "--max-tokens", "2", "--model", str(bad_files[case]))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stderr)
    assert lines[0].startswith("specserve: error:") and all(w in lines[0] for w in words), lines[0]


def test_damaged_files_are_refused_with_a_value_error_naming_the_file(gguf_path, tmp_path):
    import struct

    good = gguf_path("F32").read_bytes()
    noise = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    flipped = bytearray(good)
    flipped[200:260] = noise[:60]  # inside the metadata
    damaged = {"v3-noise": b"GGUF" + struct.pack("<I", 3) + noise, "header-noise": good[:24] + noise,
               "flipped": bytes(flipped), "tail-cut": good[:-100], "empty": b"", "magic-only": b"GGUF"}
    for name, data in damaged.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError) as info:
            GGUFFile(path)
        message = str(info.value)
        assert path.name in message and "\n" not in message, (name, message)
        assert ("truncated" in message or "corrupt" in message or "not a GGUF file" in message), (name, message)
