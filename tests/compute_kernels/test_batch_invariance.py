"""Batch and thread-count invariance of the CPU kernels, bitwise — what makes greedy speculative decoding
equal plain decoding by construction on the CPU.

- `linear_rows`: row r of a k-row product equals the 1-row product, k = 1..16, every weight storage (q4_1,
  llama.cpp's Q4_1, included), 1 and 2 threads (and the results of 1 and 2 threads are equal).
- Near ties: inputs built so that the documented order (one FMA chain over k from zero; attention keys
  in slot order) produces an exact tie that ANY other order — split, blocked, pairwise, reversed sums,
  keys in another order — breaks. The tie must hold for every row count, row position, tile, thread
  count and storage; a path that rounded differently would break it (the inputs are checked to
  discriminate).
- Whole model: row r of a k-row forward (k decodes of different sequences, in any order and subset;
  a k-token prompt chunk; a mixed batch of chunk + tree + decode) equals its 1-row forward; a verify
  row's logits for a tree node equal the logits plain decoding computes for that token at that
  position once its ancestors are committed — on GQA, biased (Qwen2) and sliding-window (Mistral)
  models, fp32, bf16, int8 (Q8_0) and int4 (Q4_0) storage, 1 and 2 threads. Logits are compared bitwise, which is stronger than
  any near-tie argmax check on a model: a single differing bit anywhere fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.kernels import PackedLinear, linear_rows
from specserve.kernels.attention import paged_attention, visible_keys
from specserve.kv_cache import BlockAllocator
from specserve.model import LlamaModel
from specserve.step_batch import StepBatchBuilder
from tiny_models import build_model

STORAGES = ["float32", "bfloat16", "float16", "int8", "int4", "q4_1"]
# int8, int4: a float16 checkpoint quantized at load (LLM(quantization=...)).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.float16,
          "int4": torch.float16}


def bits(a) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bitwise(a, b, msg="") -> None:
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=msg)


# ---- linear_rows ------------------------------------------------------------------------------------


def _product(packed: PackedLinear, x: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], packed.out_features), dtype=np.float32)
    linear_rows(np.ascontiguousarray(x), packed.weight, packed.scales, packed.bias, out, False)
    return out


@pytest.mark.parametrize("storage", STORAGES)
def test_linear_rows_row_r_of_k_rows_equals_the_one_row_product(storage, use_threads):
    # 200 outputs = 13 blocks = tiles of 2, ..., 2, 1 blocks (narrow products); 1,060 outputs = 67 blocks = tiles
    # of 4, ..., 4, 3 (wide ones): every tile shape (4 rows x 2 blocks, 4 x 1, 1 row x 4, 2 and 1 blocks) and a
    # partial last block; 77 inputs (no multiple of anything, a short last run of 32).
    gen = torch.Generator().manual_seed(0)
    for out_features in (200, 1060):
        _check_row_r_of_k_rows(PackedLinear(torch.randn(out_features, 77, generator=gen),
                                            torch.randn(out_features, generator=gen), storage), gen, use_threads)


def _check_row_r_of_k_rows(packed: PackedLinear, gen, use_threads) -> None:
    x = torch.randn(16, 77, generator=gen).numpy()
    rng = np.random.default_rng(0)
    by_threads = {}
    for threads in (1, 2):
        use_threads(threads)
        single = np.concatenate([_product(packed, x[r:r + 1]) for r in range(16)])
        for k in range(1, 17):
            rows = rng.permutation(16)[:k]  # which rows, in which order: every row lands in every tile slot
            assert_bitwise(_product(packed, x[rows]), single[rows], f"k={k} threads={threads}")
        by_threads[threads] = single
    assert_bitwise(by_threads[1], by_threads[2], "1 vs 2 threads")


def _order_tie(in_features: int) -> tuple[np.ndarray, np.ndarray, float]:
    """A weight row w and input x with x . w == 1.0 EXACTLY under the documented arithmetic (k = 0, 1, ...
    from zero, each FMA rounded to nearest even) but not under any other order: x = 1, w = [1, 2^-24,
    2^-24, ...]. In order, every 1 + 2^-24 is a tie that rounds back to 1; summed in any other grouping
    the small terms first add up to a representable amount."""
    w = np.full(in_features, 2.0 ** -24, dtype=np.float32)
    w[0] = 1.0
    return np.ones(in_features, dtype=np.float32), w, 1.0


def test_the_near_tie_inputs_discriminate():
    x, w, tie = _order_tie(64)
    terms = x * w
    reversed_sum = np.float32(0)
    for t in terms[::-1]:
        reversed_sum = np.float32(reversed_sum + t)
    blocked = np.float32(np.float32(terms[0::2].sum(dtype=np.float32)) + np.float32(terms[1::2].sum(dtype=np.float32)))
    assert reversed_sum != tie and blocked != tie and np.float32(terms.sum(dtype=np.float32)) != tie
    in_order = np.float32(0)
    for t in terms:
        in_order = np.float32(in_order + t)
    assert in_order == tie


@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
def test_near_tie_in_linear_rows_holds_for_every_row_count_tile_and_thread_count(storage, use_threads):
    # Output 0 is exactly 1.0 (one nonzero weight); outputs 17, 40 and 69 (other blocks and tiles, one in
    # the partial last block) are the order ties, exactly 1.0 only in the documented order; the rest are
    # below 1. argmax must be 0 (first of the tied maxima) on every row of every call.
    in_features, out_features = 64, 70
    x1, w_tie, tie = _order_tie(in_features)
    weight = np.zeros((out_features, in_features), dtype=np.float32)
    weight[:, 0] = 0.5
    weight[0, 0] = 1.0
    for o in (17, 40, 69):
        weight[o] = w_tie
    packed = PackedLinear(torch.from_numpy(weight), None, storage)
    for threads in (1, 2):
        use_threads(threads)
        for k in range(1, 17):
            out = _product(packed, np.tile(x1, (k, 1)))
            assert (out[:, [0, 17, 40, 69]] == tie).all(), (k, threads, out[:, [0, 17, 40, 69]])
            assert (out.argmax(axis=1) == 0).all()


def test_near_tie_in_attention_needs_keys_in_slot_order(use_threads):
    # q = 0: every visible key scores 0 and weighs exactly 1. Value dim 0 is 1 at key 0 and 2^-24 at every
    # other key; dim 1 is 1 at key 0 and 0 elsewhere. Summed in slot order (key 0 first), dim 0 stays
    # exactly 1 (each + 2^-24 is a tie rounding back), so out[..., 0] == out[..., 1]; summing the keys in
    # any other order (new tokens first, reversed, split) makes dim 0 larger.
    heads, kv_heads, head_dim, block = 4, 2, 16, 4
    allocator = BlockAllocator(12, block)
    allocator.allocate("a", 24)
    allocator.allocate("b", 24)
    slots = allocator.num_blocks * block
    k_cache = np.random.default_rng(0).standard_normal((slots, kv_heads, head_dim)).astype(np.float32)
    v_cache = np.zeros((slots, kv_heads, head_dim), dtype=np.float32)
    v_cache[:, :, 0] = 2.0 ** -24
    for seq in ("a", "b"):
        first = allocator.physical_slots(seq, np.array([0]))[0]
        v_cache[first, :, :2] = 1.0
    parents = [-1, 0, 0, 1, 3]  # a tree of 5 new tokens after 7 cached entries
    n = len(parents) + 1
    mask = np.eye(n, dtype=bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        mask[i + 1] |= mask[p + 1]
    builder = StepBatchBuilder(allocator)
    builder.add("a", 7, np.arange(n), np.array([7, 8, 8, 9, 10, 11]), mask)
    builder.add("b", 9, np.arange(3))  # a causal chunk after 9 cached entries
    batch = builder.build()
    q = np.zeros((batch.num_tokens, heads, head_dim), dtype=np.float32)
    for threads in (1, 2):
        use_threads(threads)
        out = np.full_like(q, np.nan)
        paged_attention(q, k_cache, v_cache, *visible_keys(batch, 0), np.float32(head_dim ** -0.5), out, threads)
        assert (out[..., 0] == out[..., 1]).all() and (out[..., 0] > 0).all(), out[..., :2]
    # The inputs discriminate: the same weighted sum with the keys in reversed order breaks the tie.
    acc = np.float32(0)
    for v in [2.0 ** -24] * 8 + [1.0]:
        acc = np.float32(acc + np.float32(v))
    assert acc != np.float32(1.0)


# ---- whole model --------------------------------------------------------------------------------------

ARCHS = {
    "llama-gqa": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "mistral-window4": ("mistral", dict(sliding_window=4)),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {name: build_model(tmp_path_factory.mktemp(name), arch, vocab_size=61, tokenizer=False, init_std=0.2,
                              hidden_size=64, heads=4, kv_heads=2, **extra)
            for name, (arch, extra) in ARCHS.items()}


def _model(path, storage: str) -> LlamaModel:
    model = LlamaModel.from_pretrained(path, torch.device("cpu"), DTYPES[storage],
                                       quantization=storage if storage in ("int8", "int4") else None)
    assert model.kernels is not None and model.kernels.storage == storage
    return model


def _cache(model, seqs, slots_each=48, block_size=4):
    allocator = BlockAllocator(len(seqs) * slots_each // block_size, block_size)
    for s in seqs:
        allocator.allocate(s, slots_each)
    return model.new_cache(allocator)


def _forward(model, cache, entries, logits="all") -> np.ndarray:
    """entries: (seq, num_cached, tokens[, positions, mask]) per sequence; returns logits float32[R, V]."""
    builder = StepBatchBuilder(cache.allocator)
    for seq, num_cached, tokens, *rest in entries:
        positions, mask = (rest + [None, None])[:2]
        builder.add(seq, num_cached, np.asarray(tokens, dtype=np.int64),
                    None if positions is None else np.asarray(positions, dtype=np.int64), mask, logits=logits)
    return model.forward(builder.build(), cache).logits.numpy().copy()


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8", "int4"])
def test_row_of_a_k_decode_batch_equals_the_sequence_alone(model_dirs, storage, use_threads):
    model = _model(model_dirs["llama-gqa"], storage)
    rng = np.random.default_rng(1)
    seqs = [f"s{i}" for i in range(16)]
    cache = _cache(model, seqs)
    lengths = rng.permutation(np.arange(1, 33))[:16]  # context lengths 1..32: across block boundaries
    for s, length in zip(seqs, lengths):
        _forward(model, cache, [(s, 0, rng.integers(0, 61, length))], logits="none")
    nxt = rng.integers(0, 61, 16)
    by_threads = {}
    for threads in (1, 2):
        use_threads(threads)
        single = np.concatenate([_forward(model, cache, [(s, int(n), [int(t)])]) for s, n, t in zip(seqs, lengths, nxt)])
        for k in range(1, 17):
            pick = rng.permutation(16)[:k]
            batch = _forward(model, cache, [(seqs[i], int(lengths[i]), [int(nxt[i])]) for i in pick])
            assert_bitwise(batch, single[pick], f"k={k} threads={threads}")
        by_threads[threads] = single
    assert_bitwise(by_threads[1], by_threads[2], "1 vs 2 threads")


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8", "int4"])
def test_row_of_a_k_token_chunk_equals_decoding_one_token_at_a_time(model_dirs, arch, storage, use_threads):
    model = _model(model_dirs[arch], storage)
    tokens = np.random.default_rng(2).integers(0, 61, 21)
    by_threads = {}
    for threads in (1, 2):
        use_threads(threads)
        plain = _cache(model, ["s"])
        _forward(model, plain, [("s", 0, tokens[:5])], logits="none")
        decoded = np.concatenate([_forward(model, plain, [("s", 5 + r, tokens[5 + r:6 + r])]) for r in range(16)])
        for k in range(1, 17):
            chunked = _cache(model, ["s"])
            _forward(model, chunked, [("s", 0, tokens[:5])], logits="none")
            assert_bitwise(_forward(model, chunked, [("s", 5, tokens[5:5 + k])]), decoded[:k], f"k={k} threads={threads}")
        by_threads[threads] = decoded
    assert_bitwise(by_threads[1], by_threads[2], "1 vs 2 threads")


def _random_tree(rng, num_nodes: int):
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, num_nodes)]
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    mask = np.eye(num_nodes + 1, dtype=bool)  # row/col 0: the root
    mask[:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i + 1] |= mask[p + 1]
    return parents, np.array(depth), mask


def _path(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
def test_verify_row_of_a_tree_node_equals_plain_decoding_after_its_ancestors(model_dirs, arch, storage, use_threads):
    model = _model(model_dirs[arch], storage)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 61, 11)
    for threads in (1, 2):
        use_threads(threads)
        for _ in range(2):
            parents, depth, mask = _random_tree(rng, 10)
            root, nodes = int(rng.integers(0, 61)), rng.integers(0, 61, 10)
            L = len(prompt)
            spec = _cache(model, ["s"])
            _forward(model, spec, [("s", 0, prompt)], logits="none")
            verify = _forward(model, spec, [("s", L, np.concatenate([[root], nodes]), np.concatenate([[L], L + depth]), mask)])
            plain = _cache(model, ["s"])
            _forward(model, plain, [("s", 0, prompt)], logits="none")
            assert_bitwise(_forward(model, plain, [("s", L, [root])]), verify[:1], "root row")
            for node in range(10):
                for d, ancestor in enumerate(_path(parents, node)):  # commit the ancestors, then the node
                    logits = _forward(model, plain, [("s", L + 1 + d, [int(nodes[ancestor])])])
                assert_bitwise(logits, verify[node + 1:node + 2], f"node {node} threads={threads}")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_mixed_batch_rows_equal_each_sequence_alone(model_dirs, arch, use_threads):
    # One forward: a prompt chunk, a verify tree and a decode of three sequences, as the step runner builds.
    model = _model(model_dirs[arch], "float32")
    rng = np.random.default_rng(4)
    parents, depth, mask = _random_tree(rng, 6)
    prompts = {s: rng.integers(0, 61, n) for s, n in (("chunk", 9), ("tree", 13), ("decode", 6))}
    step = [("tree", 13, rng.integers(0, 61, 7), np.concatenate([[13], 13 + depth]), mask),
            ("chunk", 4, prompts["chunk"][4:]),
            ("decode", 6, [int(rng.integers(0, 61))])]
    for threads in (1, 2):
        use_threads(threads)
        cache = _cache(model, list(prompts))
        for s, p in prompts.items():
            _forward(model, cache, [(s, 0, p if s != "chunk" else p[:4])], logits="none")
        together = _forward(model, cache, step)
        alone = np.concatenate([_forward(model, cache, [entry]) for entry in step])
        assert_bitwise(together, alone, f"threads={threads}")
