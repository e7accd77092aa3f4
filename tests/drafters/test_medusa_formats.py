"""Every published Medusa head format loads with the published math.

Each directory here is written the way its publishing project writes it — FasterDecoding/Medusa's
modules (a ModuleList of ``Sequential(ResBlock * L[, Linear(H, V, bias=False)])``, rebuilt here from the
published description, so their state dicts name the tensors), its ``MedusaConfig.save_pretrained``
(a transformers ``PretrainedConfig``), ``torch.save`` / safetensors ``save_file`` for heads, and
transformers ``save_pretrained`` for a jointly fine-tuned Medusa-2 target. The loaded heads are checked
against a reference forward written here in plain torch from the paper's formula
(``x <- x + SiLU(W x + b)`` per block, then the head's own LM head, or the target's for v2), and greedy
speculative output must equal plain greedy output through the engine.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from specserve.drafters import DraftRequest
from specserve.drafters import medusa as _medusa  # noqa: F401  (registers "medusa")
from specserve.drafters.medusa_heads import (
    MedusaHeads,
    describe_heads,
    load_heads,
    save_heads,
)
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from specserve import LLM, SamplingParams

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [11]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
H, V = 64, 16  # the small_vocab_dir target's hidden size and vocabulary


# ---- the publishing project's writers, rebuilt from its published description ---------------------


class PublishedMedusaConfig(PretrainedConfig):
    """Medusa's config class: these fields, saved by ``save_pretrained`` as config.json."""

    def __init__(self, medusa_num_heads=5, medusa_num_layers=1, base_model_name_or_path="lmsys/vicuna-7b-v1.3",
                 version=None, **kwargs):
        super().__init__(**kwargs)
        self.medusa_num_heads = medusa_num_heads
        self.medusa_num_layers = medusa_num_layers
        self.base_model_name_or_path = base_model_name_or_path
        if version is not None:  # the v2 trainer's config carries "version": "2"; Medusa-1's none
            self.version = version


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def published_heads(num_heads: int, num_layers: int, with_lm_head: bool, seed: int) -> nn.ModuleList:
    """Medusa's head list: ONE ResBlock object repeated ``num_layers`` times per head (``[ResBlock] * L``),
    then (Medusa-1) the head's own LM head; random weights that disagree with the target."""
    torch.manual_seed(seed)
    heads = nn.ModuleList()
    for _ in range(num_heads):
        block = ResBlock(H)
        layers = [block] * num_layers + ([nn.Linear(H, V, bias=False)] if with_lm_head else [])
        heads.append(nn.Sequential(*layers))
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape) * 0.4)
    return heads


def reference_logits(state: dict[str, torch.Tensor], num_heads: int, num_layers: int, h: torch.Tensor,
                     target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
    """The published math in plain torch, from the saved tensors: [K, N, V] for features h [N, H]."""
    out = []
    for k in range(num_heads):
        x = h
        for layer in range(num_layers):
            w, b = state[f"{k}.{layer}.linear.weight"].float(), state[f"{k}.{layer}.linear.bias"].float()
            y = x @ w.T + b
            x = x + y * torch.sigmoid(y)
        lm = target_lm_head if target_lm_head is not None else state[f"{k}.{num_layers}.weight"].float()
        out.append(x @ lm.T)
    return torch.stack(out)


def write_medusa1(out, target_dir, *, num_heads=3, num_layers=1, config_heads=None, suffix="pt",
                  dtype=torch.float16, seed=0) -> dict[str, torch.Tensor]:
    """Medusa-1 heads as published (medusa_lm_head.pt, fp16, for the vicuna heads); returns the state saved."""
    out.mkdir(parents=True, exist_ok=True)
    PublishedMedusaConfig(config_heads or num_heads, num_layers, str(target_dir)).save_pretrained(out)
    state = published_heads(num_heads, num_layers, True, seed).to(dtype).state_dict()
    if suffix == "pt":
        torch.save(state, out / "medusa_lm_head.pt")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "medusa_lm_head.safetensors"))
    return state


def write_medusa_v2(out, target_dir, *, num_heads=3, dtype=torch.bfloat16, seed=1) -> dict[str, torch.Tensor]:
    """Medusa v2 heads as its trainer writes them (train_legacy.py): config version "2", the blocks' state
    dict in medusa_lm_head.safetensors, no LM head (the target's is used)."""
    out.mkdir(parents=True, exist_ok=True)
    PublishedMedusaConfig(num_heads, 1, str(target_dir), version="2").save_pretrained(out)
    state = published_heads(num_heads, 1, False, seed).to(dtype).state_dict()
    save_file(state, str(out / "medusa_lm_head.safetensors"))
    return state


def write_medusa2_joint(out, target_dir, *, num_heads=3, seed=2) -> dict[str, torch.Tensor]:
    """A Medusa-2 checkpoint: the target with ``medusa_head`` attached and the medusa fields on its config,
    saved by transformers ``save_pretrained`` (sharded, to take the index path). The target weights
    are the original ones, so its plain greedy output is the original's."""
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.medusa_head = published_heads(num_heads, 1, True, seed)
    model.config.medusa_num_heads, model.config.medusa_num_layers = num_heads, 1
    model.save_pretrained(out, max_shard_size="40KB")
    return {k.removeprefix("medusa_head."): v for k, v in model.state_dict().items() if k.startswith("medusa_head.")}


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(small_vocab_dir):
    return [o.token_ids for o in LLM(small_vocab_dir, device="cpu").generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def target_lm_head(small_vocab_dir):
    with safe_open(str(small_vocab_dir / "model.safetensors"), "pt") as f:
        return f.get_tensor("lm_head.weight").float()


@pytest.fixture(scope="module")
def joint_dir(small_vocab_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa2_joint")
    return out, write_medusa2_joint(out, small_vocab_dir)


def _features(n=5, seed=0):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)) * 2


def _check_loaded(path, state, num_heads, num_layers, lm_head=None):
    """Per-head logits within fp32 tolerance of the reference, and the heads' LM heads as expected."""
    loaded = load_heads(path, hidden_size=H, vocab_size=V)
    heads = loaded.heads
    assert heads.num_heads == num_heads and heads.num_layers == num_layers
    assert (heads.lm_heads is None) == (lm_head is not None)
    h = _features()
    ref = reference_logits(state, num_heads, num_layers, h, lm_head)
    with torch.no_grad():
        got = heads(h, lm_head)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    return loaded


def _greedy_tokens_per_head(llm, h):
    """The drafter's depth-d node of a [[0], [0, 0], ...] chain is its head d-1's argmax at feature h [1, H]."""
    drafter = llm.engine.drafter
    req = DraftRequest("x", np.asarray([1, 2, 3], dtype=np.int64), 0.0, {drafter.feature_layer: h}, None)
    tree = drafter.propose([req], [drafter.max_budget])[0]
    drafter.release("x")
    return tree.tokens.tolist()


def _check_engine(small_vocab_dir, path, plain, state, num_heads, num_layers, lm_head=None, model=None):
    chain = json.dumps([[0] * d for d in range(1, num_heads + 1)])
    llm = LLM(model or small_vocab_dir, drafter=f"medusa:{path}" if path else "medusa",
              drafter_options={"choices": chain}, device="cpu", speculation="static")
    h = _features(1, seed=3)
    ref = reference_logits(state, num_heads, num_layers, h, lm_head)[:, 0]  # [K, V]
    assert _greedy_tokens_per_head(llm, h) == ref.argmax(-1).tolist()
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    return llm


# ---- the formats ---------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
def test_medusa1_heads(small_vocab_dir, tmp_path, plain, suffix):
    state = write_medusa1(tmp_path, small_vocab_dir, suffix=suffix)
    assert set(state) == {f"{k}.{n}" for k in range(3) for n in ("0.linear.weight", "0.linear.bias", "1.weight")}
    loaded = _check_loaded(tmp_path, state, 3, 1)
    assert loaded.layout == "medusa" and "Medusa-1" in loaded.format
    _check_engine(small_vocab_dir, tmp_path, plain, state, 3, 1)
    info = describe_heads(tmp_path, small_vocab_dir)
    assert info["heads"] == "3" and info["layers per head"] == "1" and info["lm head"].startswith("own")
    assert info["vocabulary"] == "16" and info["fits the target"] == "yes" and "Medusa-1" in info["format"]


def test_medusa1_repeated_block_is_applied_per_layer(small_vocab_dir, tmp_path):
    """Upstream's ``[ResBlock] * L`` applies one block L times; its .pt holds L equal copies."""
    state = write_medusa1(tmp_path, small_vocab_dir, num_heads=2, num_layers=2)
    assert torch.equal(state["0.0.linear.weight"], state["0.1.linear.weight"])
    _check_loaded(tmp_path, state, 2, 2)
    assert describe_heads(tmp_path)["layers per head"] == "2"


def test_medusa_v2_heads_end_in_the_targets_lm_head(small_vocab_dir, tmp_path, plain, target_lm_head):
    state = write_medusa_v2(tmp_path, small_vocab_dir)
    with safe_open(str(tmp_path / "medusa_lm_head.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(f"{k}.0.linear.{p}" for k in range(3) for p in ("weight", "bias"))
    assert json.loads((tmp_path / "config.json").read_text())["version"] == "2"
    loaded = _check_loaded(tmp_path, state, 3, 1, lm_head=target_lm_head)
    assert "v2" in loaded.format
    _check_engine(small_vocab_dir, tmp_path, plain, state, 3, 1, lm_head=target_lm_head)
    info = describe_heads(tmp_path, small_vocab_dir)
    assert info["version"] == "2" and info["lm head"].startswith("shared: the target's")
    assert info["vocabulary"] == "16 (the target's)" and info["hidden size"] == "64" and info["fits the target"] == "yes"


def test_the_files_decide_the_lm_head_not_the_version(small_vocab_dir, tmp_path):
    """A Medusa-1 head whose config was re-saved through the v2 config class (which defaults to version
    "2") still holds, and needs, its own LM heads — as TGI reads it (Medusa-1 first, v2 if that fails)."""
    state = write_medusa1(tmp_path, small_vocab_dir, suffix="safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "version": "2"}))
    _check_loaded(tmp_path, state, 3, 1)
    info = describe_heads(tmp_path)
    assert info["version"] == "2" and info["lm head"].startswith("own")


def test_config_naming_fewer_heads_uses_the_first(small_vocab_dir, tmp_path, plain):
    state = write_medusa1(tmp_path, small_vocab_dir, num_heads=4, config_heads=2, suffix="safetensors")
    _check_loaded(tmp_path, state, 2, 1)
    _check_engine(small_vocab_dir, tmp_path, plain, state, 2, 1)
    assert describe_heads(tmp_path)["heads"].startswith("2 (the file holds 4")
    more = tmp_path / "more"
    write_medusa1(more, small_vocab_dir, num_heads=2, config_heads=3)
    with pytest.raises(ValueError, match=r"config\.json.*medusa_num_heads is 3 but .*medusa_lm_head\.pt.* holds 2"):
        load_heads(more, hidden_size=H, vocab_size=V)
    with pytest.raises(ValueError, match=r"medusa_num_heads is 3 but"):
        describe_heads(more)


def test_medusa2_joint_target_loads_as_target_and_drafter(small_vocab_dir, joint_dir, plain):
    path, state = joint_dir
    assert not (path / "model.safetensors").exists() and (path / "model.safetensors.index.json").is_file()
    config = json.loads((path / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["model_type"] == "llama"
    assert LLM(path, drafter=None, device="cpu").generate(PROMPTS, GREEDY)[0].token_ids == plain[0]
    loaded = _check_loaded(path, state, 3, 1)
    assert "Medusa-2" in loaded.format
    for spec_path in (path, None):  # medusa:DIR and a bare medusa: the target's own directory
        llm = _check_engine(small_vocab_dir, spec_path, plain, state, 3, 1, model=path)
        assert llm.engine.drafter.path == str(path)
    info = describe_heads(path, path)
    assert "Medusa-2" in info["format"] and info["lm head"] == "own, one per head, in the model shards"
    assert info["fits the target"] == "yes"


def test_clear_errors(small_vocab_dir, tmp_path):
    bad_version = tmp_path / "v3"
    write_medusa_v2(bad_version, small_vocab_dir)
    config = json.loads((bad_version / "config.json").read_text())
    (bad_version / "config.json").write_text(json.dumps({**config, "version": "3"}))
    with pytest.raises(ValueError, match=r"config\.json.*version '3' is not a Medusa version"):
        load_heads(bad_version, hidden_size=H, vocab_size=V)
    mixed = tmp_path / "mixed"
    state = write_medusa1(mixed, small_vocab_dir, num_heads=2, suffix="safetensors")
    del state["1.1.weight"]
    save_file(state, str(mixed / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"heads \[0\] have an LM head .* heads \[1\] do not"):
        load_heads(mixed, hidden_size=H, vocab_size=V)
    bare = tmp_path / "bare"
    shutil.copytree(small_vocab_dir, bare)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 2}))
    with pytest.raises(ValueError, match=r"no medusa_lm_head\.safetensors.*no medusa_head\.\* tensors"):
        load_heads(bare, hidden_size=H, vocab_size=V)
    with pytest.raises(ValueError, match="needs a heads directory"):
        LLM(small_vocab_dir, drafter="medusa", device="cpu")
    vllm = tmp_path / "vllm"  # vLLM's converted layout: refused by name, not misread
    vllm.mkdir()
    (vllm / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 2, "num_hidden_layers": 1,
                                                  "hidden_size": H, "vocab_size": V}))
    with pytest.raises(ValueError, match="vLLM's converted Medusa layout"):
        load_heads(vllm, hidden_size=H, vocab_size=V)


def test_describe_our_heads_and_a_target_that_does_not_fit(small_vocab_dir, tmp_path):
    save_heads(MedusaHeads(H, V, 2, 1, "shared"), tmp_path / "ours", small_vocab_dir)
    info = describe_heads(tmp_path / "ours", small_vocab_dir)
    assert info["format"].startswith("specserve") and info["heads"] == "2" and info["lm head"] == "shared: the target's"
    assert info["version"] == "1" and info["weights"].endswith("medusa_heads.safetensors")
    assert info["trained for"] == str(small_vocab_dir.resolve()) and info["fits the target"] == "yes"
    write_medusa1(tmp_path / "m1", small_vocab_dir)
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    (narrow / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "vocab_size": V}))
    assert describe_heads(tmp_path / "m1", narrow)["fits the target"] == "no: hidden size 64 vs the target's 32"
