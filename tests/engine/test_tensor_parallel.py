"""Tensor parallelism on the CPU: two gloo ranks (the test process is rank 0, `LLM` spawns rank 1).

- TP=2 greedy output equals TP=1 (one device, the same torch layers) for plain decoding and every
  drafter kind: n-gram, suffix, lookahead, a draft model, an EAGLE-3 head (reads the target's hidden
  states and embeddings on rank 0), Medusa heads sharing the target's LM head (rank 0 keeps it whole).
  Not bitwise (the all-reduce sums partial products in another order), but no tie within rounding
  occurs on these models, so the tokens agree.
- Sampled output has the target's distribution under TP=2 (the chi-square test of
  test_lossless_sampling.py, on trees drawn near the greedy path).
- Each rank holds its share of the KV cache (its kv heads) and read only its slices of the checkpoint.
"""

from __future__ import annotations

import pytest
import torch

import scripted_drafter  # noqa: F401  (registers "scripted")
from specserve import LLM, SamplingParams
from specserve.checkpoint import expected_shapes
from specserve.config import load_config
from specserve.tensor_parallel import Shard, slice_of
from target_stats import SAMPLED_MAX_TOKENS, assert_follows_target

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def one_device(small_vocab_dir):
    llm = LLM(small_vocab_dir, drafter=None, attention="sdpa")  # the torch layers, as every TP rank runs them
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def drafter_dirs(small_vocab_dir, tmp_path_factory):
    from specserve.drafters.eagle_checkpoint import new_head_config, save_head
    from specserve.drafters.eagle_head import EagleHead
    from specserve.drafters.medusa_heads import MedusaHeads, save_heads
    from specserve.model import LlamaModel

    target = LlamaModel.from_pretrained(small_vocab_dir, torch.device("cpu"), torch.float32, cpu_kernels=False)
    gen = torch.Generator().manual_seed(0)
    head = EagleHead(new_head_config(small_vocab_dir, "eagle3"), target.embed, target.lm_head)
    medusa = MedusaHeads(target.config.hidden_size, target.config.vocab_size, 3, 1, "shared")
    with torch.no_grad():
        for p in list(head.parameters()) + list(medusa.parameters()):
            p.copy_((torch.randn(p.shape, generator=gen) * 0.3).half().float())
    eagle_dir = save_head(head, tmp_path_factory.mktemp("eagle3"), torch.float32)
    medusa_dir = tmp_path_factory.mktemp("medusa")
    save_heads(medusa, medusa_dir, small_vocab_dir)
    return {"eagle": eagle_dir, "medusa": medusa_dir}


def test_tp2_plain_and_every_drafter_equal_one_device(small_vocab_dir, near_draft_dir, drafter_dirs, one_device):
    specs = [None, "ngram", "suffix", "lookahead", f"draft:{near_draft_dir}", f"eagle:{drafter_dirs['eagle']}",
             f"medusa:{drafter_dirs['medusa']}"]
    for spec in specs:
        with LLM(small_vocab_dir, drafter=spec, tensor_parallel_size=2, speculation="static") as llm:
            assert llm.tensor_parallel_size == 2 and llm.model.kernels is None
            outs = llm.generate(PROMPTS, GREEDY)
            assert [o.token_ids for o in outs] == one_device, spec
            if spec in ("ngram", "suffix") or (spec or "").startswith("draft:"):
                assert sum(sum(o.spec.accepted_per_position) for o in outs) > 0, spec  # drafts were verified


def test_tp2_sampling_follows_the_target(small_vocab_dir):
    prompt, n = [3, 1, 4, 1, 5], 1500
    params = [SamplingParams(max_tokens=SAMPLED_MAX_TOKENS, seed=s, ignore_eos=True, temperature=1.0) for s in range(n)]
    greedy = LLM(small_vocab_dir, drafter=None).generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))
    with LLM(small_vocab_dir, drafter="scripted", tensor_parallel_size=2, speculation="static", max_num_seqs=n,
             max_prefill_tokens=n * len(prompt), drafter_options={
                 "mode": "deep_chain", "seed": 7, "references": [prompt + greedy[0].token_ids], "max_budget": 6}) as llm:
        outs = llm.generate([prompt] * n, params)
    assert_follows_target(outs, small_vocab_dir, prompt, params[0])
    assert sum(sum(o.spec.accepted_per_position) for o in outs) > n // 10


def test_each_rank_holds_its_kv_share_and_reads_only_its_slices(llama_dir):
    cfg = load_config(llama_dir)
    with LLM(llama_dir, drafter=None, tensor_parallel_size=2) as llm:
        llm.generate(["def f(x):"], GREEDY)
        ranks = llm.describe_ranks()
        slots = llm.engine.cache.k.shape[1]
    full = expected_shapes(cfg)
    itemsize = 4  # the tiny checkpoints are float32
    total = sum(torch.Size(s).numel() for s in full.values()) * itemsize
    for info in ranks:
        shard = Shard(info["rank"], 2)
        assert info["num_heads"] == cfg.num_heads // 2 and info["num_kv_heads"] == cfg.num_kv_heads // 2
        assert info["kv_shape"] == (cfg.num_layers, slots, cfg.num_kv_heads // 2, cfg.head_dim)
        expected = 0
        for name, shape in full.items():
            part = slice_of(name, cfg, shard)
            n = torch.Size(shape).numel()
            expected += n if part is None else n // shape[part[0]] * (part[2] - part[1])
        assert info["checkpoint_bytes_read"] == expected * itemsize
        assert info["checkpoint_bytes_read"] < total
    assert ranks[0]["pid"] != ranks[1]["pid"]


def test_a_model_the_ranks_cannot_split_evenly_is_refused_before_anything_starts(small_vocab_dir):
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads"):
        LLM(small_vocab_dir, drafter=None, tensor_parallel_size=3)


def test_a_sharded_checkpoint_is_read_slice_by_slice(llama_dir, tmp_path):
    """*.safetensors.index.json: each rank opens every shard but reads only its slices of each tensor."""
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(llama_dir)).save_pretrained(str(sharded), max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (llama_dir / name).exists():
            (sharded / name).write_bytes((llama_dir / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 2
    reference = [o.token_ids for o in LLM(llama_dir, drafter=None, attention="sdpa").generate(PROMPTS, GREEDY)]
    with LLM(sharded, drafter=None, tensor_parallel_size=2) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        read = [r["checkpoint_bytes_read"] for r in llm.describe_ranks()]
    with LLM(llama_dir, drafter=None, tensor_parallel_size=2) as llm:
        assert [r["checkpoint_bytes_read"] for r in llm.describe_ranks()] == read  # the same slices either way


def test_the_server_streams_from_a_tensor_parallel_target(llama_dir):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "server"))
    from server_utils import greedy_text
    from wsclient import Conn

    from specserve.server import BackgroundServer, ServerConfig

    expected = greedy_text(LLM(llama_dir, drafter=None, attention="sdpa"), "def f(x):", 12, ignore_eos=True)
    with LLM(llama_dir, drafter="ngram", tensor_parallel_size=2) as llm:
        with BackgroundServer(llm, ServerConfig(port=0, threads=1)) as srv, Conn(srv.ws_url) as c:
            rid = c.create(input="def f(x):", max_output_tokens=12, temperature=0, ignore_eos=True)
            assert c.wait_done(rid)["status"] == "incomplete"
            assert c.text(rid) == expected
