"""Every published EAGLE head layout loads with the right math (issue 17).

Each case writes a tiny random head exactly as its project publishes it (file names, tensor names,
dtypes, config fields), loads it, and checks its logits against a reference forward written here
from the published math in plain torch (none of specserve's modules): through the inference path
on the CPU kernels, the torch layer, and the training unroll. Then greedy speculative decoding with
it must equal plain greedy decoding. Cases:

- SafeAILab EAGLE-3: fp16 ``pytorch_model.bin``, ``midlayer.*``, reduced vocabulary (d2t/t2d), a
  copy of the target's embeddings (shared, not kept).
- SpecForge EAGLE-3: ``model.safetensors``, ``midlayer.*``, ``eagle_config`` feature layer ids
  (SGLang numbering: the output of layer j).
- speculators EAGLE-3: ``transformer_layer_config``, two decoder layers (``layers.0/1``),
  ``norm_before_residual``, its own (different) embeddings, shards + ``model.safetensors.index.json``.
- speculators EAGLE-3, Llama ``attention_bias`` (q/k/v and o biases), ``draft_vocab_size: null``,
  ``pytorch_model.bin.index.json`` shards, ``layers.0`` detected as EAGLE-3 by ``fc`` [H, 3H].
- speculators EAGLE-3 with a Qwen3 layer (per-head q/k norms).
- SafeAILab EAGLE-1 for a Qwen2-family target: ``qkv_bias``, ``fc.bias``, fp16 ``pytorch_model.bin``;
  and a two-layer EAGLE-1 (``layers.1`` with its input norm).
- speculators' legacy "eagle" (EAGLE-1): ``fusion_fc.*`` with its bias, ``transformer.*``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import specserve.drafters.eagle  # noqa: F401  (registers "eagle")
from specserve import LLM, SamplingParams
from specserve.drafters import TargetInfo
from specserve.drafters.eagle_checkpoint import describe_head, load_head
from specserve.kv_cache import BlockAllocator
from specserve.model import LlamaModel
from specserve.step_batch import StepBatchBuilder

H, HEADS, KV, HD, INTER, V = 64, 4, 2, 16, 96, 16
DRAFT_IDS = [0, 1, 2, 3, 5, 6, 7, 9, 11, 12, 13, 15]
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

# name: (upstream, EAGLE version, decoder layers, layer type, norm_before_residual, vocabulary, embeddings, files)
CASES = {
    "safeailab-eagle3": dict(project="safeailab", mode="eagle3", layers=1, layer_type="llama", nbr=False,
                             reduced=True, embed="copy", files="bin"),
    "specforge-eagle3": dict(project="specforge", mode="eagle3", layers=1, layer_type="llama", nbr=False,
                             reduced=True, embed="copy", files="safetensors"),
    "speculators-eagle3-2layers-nbr-own-embed": dict(project="speculators", mode="eagle3", layers=2, layer_type="llama",
                                                     nbr=True, reduced=True, embed="own", files="safetensors-index"),
    "speculators-eagle3-attention-bias": dict(project="speculators", mode="eagle3", layers=1, layer_type="llama-bias",
                                              nbr=False, reduced=False, embed="none", files="bin-index"),
    "speculators-eagle3-qwen3-layer": dict(project="speculators", mode="eagle3", layers=1, layer_type="qwen3", nbr=True,
                                           reduced=True, embed="none", files="safetensors"),
    "safeailab-eagle1-qwen2": dict(project="safeailab", mode="eagle1", layers=1, layer_type="qwen2", nbr=False,
                                   reduced=False, embed="copy", files="bin"),
    "safeailab-eagle1-2layers": dict(project="safeailab", mode="eagle1", layers=2, layer_type="llama", nbr=False,
                                     reduced=False, embed="none", files="safetensors"),
    "speculators-eagle1": dict(project="speculators", mode="eagle1", layers=1, layer_type="llama", nbr=False,
                               reduced=False, embed="none", files="safetensors"),
}


# ---- writing heads as their projects do -------------------------------------------------------------


def _target_weights(target_dir) -> dict[str, torch.Tensor]:
    return load_file(str(target_dir / "model.safetensors"))


def _rope_theta(target_dir) -> float:
    cfg = json.loads((target_dir / "config.json").read_text())
    return float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])


def _layer_tensors(gen, prefix: str, attn_in: int, layer_type: str, first: bool, mode: str) -> dict:
    def w(*shape, std=0.2):
        return torch.randn(*shape, generator=gen) * std

    def norm():
        return 1.0 + 0.1 * torch.randn(H, generator=gen)

    t = {f"{prefix}self_attn.q_proj.weight": w(HEADS * HD, attn_in), f"{prefix}self_attn.k_proj.weight": w(KV * HD, attn_in),
         f"{prefix}self_attn.v_proj.weight": w(KV * HD, attn_in), f"{prefix}self_attn.o_proj.weight": w(H, HEADS * HD),
         f"{prefix}post_attention_layernorm.weight": norm(), f"{prefix}mlp.gate_proj.weight": w(INTER, H),
         f"{prefix}mlp.up_proj.weight": w(INTER, H), f"{prefix}mlp.down_proj.weight": w(H, INTER)}
    if layer_type in ("qwen2", "llama-bias"):
        for n, rows in (("q", HEADS * HD), ("k", KV * HD), ("v", KV * HD)):
            t[f"{prefix}self_attn.{n}_proj.bias"] = w(rows, std=0.3)
    if layer_type == "llama-bias":
        t[f"{prefix}self_attn.o_proj.bias"] = w(H, std=0.3)
    if layer_type == "qwen3":
        t[f"{prefix}self_attn.q_norm.weight"] = 1.0 + 0.1 * torch.randn(HD, generator=gen)
        t[f"{prefix}self_attn.k_norm.weight"] = 1.0 + 0.1 * torch.randn(HD, generator=gen)
    if first and mode == "eagle3":
        t[f"{prefix}input_layernorm.weight"] = norm()
        t[f"{prefix}hidden_norm.weight"] = norm()
    elif not first:  # EAGLE-1's first layer has no input norm; later layers are ordinary ones
        t[f"{prefix}input_layernorm.weight"] = norm()
    return t


def write_head(out, target_dir, case: dict, seed: int = 0) -> dict:
    """Write a head as ``case['project']`` does; return the published tensors (for the reference)."""
    gen = torch.Generator().manual_seed(seed)
    target = _target_weights(target_dir)
    tcfg = json.loads((target_dir / "config.json").read_text())
    mode, layers, layer_type = case["mode"], case["layers"], case["layer_type"]
    eagle3 = mode == "eagle3"
    legacy = case["project"] == "speculators" and not eagle3  # speculators' "eagle": its own names
    first = ("midlayer." if case["project"] in ("safeailab", "specforge") and eagle3
             else "transformer." if legacy else "layers.0.")
    state = _layer_tensors(gen, first, 2 * H if eagle3 else H, layer_type, True, mode)
    for i in range(1, layers):
        state.update(_layer_tensors(gen, f"layers.{i}.", H, layer_type, False, mode))
    if eagle3:
        vd = len(DRAFT_IDS) if case["reduced"] else V
        state["fc.weight"] = torch.randn(H, 3 * H, generator=gen) * 0.1
        state["norm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=gen)
        state["lm_head.weight"] = torch.randn(vd, H, generator=gen) * 0.3
        if case["reduced"]:
            state["d2t"] = torch.tensor(DRAFT_IDS) - torch.arange(vd)  # target id minus draft id
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[DRAFT_IDS] = True
            state["t2d"] = t2d
    else:
        fc = "fusion_fc." if legacy else "fc."
        state[fc + "weight"] = torch.randn(H, 2 * H, generator=gen) * 0.1
        state[fc + "bias"] = torch.randn(H, generator=gen) * 0.1
    if case["embed"] == "copy":
        state["embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
    elif case["embed"] == "own":
        state["embed_tokens.weight"] = torch.randn(V, H, generator=gen) * 0.5
    if case["files"].startswith("bin"):  # SafeAILab's training saves: fp16 pickles
        state = {k: (v.half() if v.is_floating_point() else v) for k, v in state.items()}
    _write_files(out, state, case["files"])
    _write_config(out, tcfg, case)
    return {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}


def _write_files(out, state: dict, files: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in state.items()}
    if files == "bin":
        torch.save(state, out / "pytorch_model.bin")
    elif files == "safetensors":
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:  # two shards and the transformers index naming them
        names = sorted(state)
        halves = {f"-0000{i + 1}-of-00002": names[i::2] for i in range(2)}
        weight_map = {}
        for tag, part in halves.items():
            if files == "bin-index":
                file = f"pytorch_model{tag}.bin"
                torch.save({k: state[k] for k in part}, out / file)
            else:
                file = f"model{tag}.safetensors"
                save_file({k: state[k] for k in part}, str(out / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in part})
        index = "pytorch_model.bin.index.json" if files == "bin-index" else "model.safetensors.index.json"
        (out / index).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def _write_config(out, tcfg: dict, case: dict) -> None:
    layer = {"hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV,
             "head_dim": HD, "num_hidden_layers": case["layers"], "rms_norm_eps": tcfg["rms_norm_eps"],
             "max_position_embeddings": 512, "vocab_size": V, "rope_theta": tcfg["rope_parameters"]["rope_theta"]}
    vd = len(DRAFT_IDS) if case["reduced"] else None
    if case["project"] == "speculators" and case["mode"] == "eagle1":
        config = {"architectures": ["EagleSpeculator"], "speculators_model_type": "eagle", "layernorms": False,
                  "fusion_bias": True, "transformer_layer_config": {**layer, "model_type": "llama"},
                  "speculators_config": {"algorithm": "eagle", "verifier": {"name_or_path": "tiny/target"}}}
    elif case["project"] == "speculators":
        # transformers' diff dict of the layer's config: hidden_act (the default) is left out
        layer_cfg = {**layer, "model_type": "qwen3" if case["layer_type"] == "qwen3" else "llama",
                     "architectures": ["LlamaForCausalLM"], "attention_bias": case["layer_type"] == "llama-bias"}
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_version": "0.2.0", "draft_vocab_size": vd, "norm_before_residual": case["nbr"],
                  "target_hidden_size": None, "transformer_layer_config": layer_cfg,
                  "eagle_aux_hidden_state_layer_ids": [1, 2, 0],
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                         "verifier": {"name_or_path": "tiny/target", "architectures": ["LlamaForCausalLM"]}}}
    elif case["mode"] == "eagle3":
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
                  "torch_dtype": "float16", "tie_word_embeddings": False, **layer, "draft_vocab_size": vd}
        if case["project"] == "specforge":  # SGLang numbering: the output of layer j (our index j + 1)
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 0], "use_aux_hidden_state": True}
    else:  # EAGLE-1 for a Qwen2 target (EAGLE's own Qwen2 configs say qkv_bias)
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "bias": True,
                  "torch_dtype": "float16", **layer}
        if case["layer_type"] == "qwen2":
            config["qkv_bias"] = True
    (out / "config.json").write_text(json.dumps(config, indent=1))


def feature_layers(case: dict) -> tuple[int, ...]:
    if case["mode"] == "eagle1":
        return (2,)
    return {"speculators": (1, 2, 0), "specforge": (1, 2, 1), "safeailab": (1, 1, 1)}[case["project"]]


# ---- the reference forward: the published math in plain torch --------------------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    return torch.cat([-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]], dim=-1)


def _ref_layer(sd, p, attn_in, residual, theta, eps, qk_norm):
    """A decoder layer as transformers' LlamaDecoderLayer computes it, causal over positions 0..T-1."""
    t = attn_in.shape[0]

    def lin(x, name):
        y = x @ sd[p + name + ".weight"].T
        return y + sd[p + name + ".bias"] if p + name + ".bias" in sd else y

    q = lin(attn_in, "self_attn.q_proj").view(t, HEADS, HD)
    k = lin(attn_in, "self_attn.k_proj").view(t, KV, HD)
    v = lin(attn_in, "self_attn.v_proj").view(t, KV, HD)
    if qk_norm:
        q, k = _rms(q, sd[p + "self_attn.q_norm.weight"], eps), _rms(k, sd[p + "self_attn.k_norm.weight"], eps)
    inv = 1.0 / theta ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = (torch.cat([f(ang), f(ang)], -1).float()[:, None] for f in (torch.cos, torch.sin))
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, HEADS * HD)
    x = residual + lin(attn, "self_attn.o_proj")
    h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
    return x + lin(torch.nn.functional.silu(lin(h, "mlp.gate_proj")) * lin(h, "mlp.up_proj"), "mlp.down_proj")


def reference_logits(sd, case, tokens, feats, target, theta, eps):
    """Logits [T, Vd] of the pairs (feats[i], tokens[i]) at positions 0..T-1."""
    # A copy of the target's table is the target's (an fp16 copy differs only by export rounding).
    embed = (sd["embed_tokens.weight"] if case["embed"] == "own" else target["model.embed_tokens.weight"])[tokens]
    qk_norm = case["layer_type"] == "qwen3"
    if case["mode"] == "eagle1":  # no input norm in the first layer; the target's LM head, no norm
        fc, first = ("fusion_fc.", "transformer.") if "fusion_fc.weight" in sd else ("fc.", "layers.0.")
        x = torch.cat([embed, feats[0]], -1) @ sd[fc + "weight"].T + sd[fc + "bias"]
        x = _ref_layer(sd, first, x, x, theta, eps, qk_norm)
        for i in range(1, case["layers"]):
            p = f"layers.{i}."
            x = _ref_layer(sd, p, _rms(x, sd[p + "input_layernorm.weight"], eps), x, theta, eps, qk_norm)
        return x @ target["lm_head.weight"].T
    first = "midlayer." if any(k.startswith("midlayer.") for k in sd) else "layers.0."
    f = torch.cat(feats, -1) @ sd["fc.weight"].T
    normed = _rms(f, sd[first + "hidden_norm.weight"], eps)
    attn_in = torch.cat([_rms(embed, sd[first + "input_layernorm.weight"], eps), normed], -1)
    x = _ref_layer(sd, first, attn_in, normed if case["nbr"] else f, theta, eps, qk_norm)
    for i in range(1, case["layers"]):
        p = f"layers.{i}."
        x = _ref_layer(sd, p, _rms(x, sd[p + "input_layernorm.weight"], eps), x, theta, eps, qk_norm)
    return _rms(x, sd["norm.weight"], eps) @ sd["lm_head.weight"].T


# ---- tests --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(small_vocab_dir):
    model = LlamaModel.from_pretrained(small_vocab_dir, torch.device("cpu"), torch.float32)
    cfg = model.config
    return TargetInfo(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                      device=torch.device("cpu"), dtype=torch.float32, model_dir=str(small_vocab_dir), model=model)


@pytest.fixture(scope="module")
def plain(small_vocab_dir):
    return [o.token_ids for o in LLM(small_vocab_dir, device="cpu").generate(PROMPTS, GREEDY)]


def _inference_logits(head, tokens, feats):
    allocator = BlockAllocator(8, 16)
    allocator.allocate("r", len(tokens))
    builder = StepBatchBuilder(allocator)
    builder.add("r", 0, tokens.numpy())
    out = head(tokens, head.fuse(feats), builder.build(), head.new_cache(allocator))
    return head.logits(out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_published_layout_loads_with_the_published_math(small_vocab_dir, target, plain, tmp_path, name):
    case = CASES[name]
    sd = write_head(tmp_path / name, small_vocab_dir, case)
    head = load_head(tmp_path / name, target)
    cfg = head.cfg
    assert (cfg.mode, cfg.num_layers, cfg.norm_before_residual) == (case["mode"], case["layers"], case["nbr"])
    assert cfg.feature_layers == feature_layers(case)
    assert cfg.own_embed == (case["embed"] == "own")  # a copy of the target's table is shared, not kept
    if case["reduced"]:
        assert head.draft_to_target.tolist() == DRAFT_IDS

    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, V, (9,), generator=gen)
    feats = [torch.randn(9, H, generator=gen) for _ in cfg.feature_layers]
    tw = _target_weights(small_vocab_dir)
    want = reference_logits(sd, case, tokens, feats, tw, _rope_theta(small_vocab_dir),
                            json.loads((small_vocab_dir / "config.json").read_text())["rms_norm_eps"])
    assert head.kernels is not None  # the CPU kernels' path is what serving runs here
    torch.testing.assert_close(_inference_logits(head, tokens, feats), want, atol=2e-4, rtol=2e-4)
    kernels, head.kernels = head.kernels, None  # the torch layer (GPU path) and the training unroll
    try:
        torch.testing.assert_close(_inference_logits(head, tokens, feats), want, atol=2e-4, rtol=2e-4)
        with torch.no_grad():
            step0 = head.unroll(tokens[None], head.fuse([f[None] for f in feats]), 2)[0][0]
        torch.testing.assert_close(head.logits(step0), want, atol=2e-4, rtol=2e-4)
    finally:
        head.kernels = kernels

    llm = LLM(small_vocab_dir, drafter=f"eagle:{tmp_path / name}", drafter_options={"depth": 3, "topk": 2},
              device="cpu", speculation="static")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert sum(sum(o.spec.drafted_per_position) for o in outs) > 0
    drafter = llm.engine.drafter
    assert drafter.cache.k.shape[0] == case["layers"]  # one KV layer per decoder layer, counted at admission
    assert drafter.kv_bytes_per_slot() == 2 * case["layers"] * KV * HD * 4


def test_describe_head_says_what_was_detected(small_vocab_dir, target, tmp_path):
    write_head(tmp_path / "s", small_vocab_dir, CASES["speculators-eagle3-2layers-nbr-own-embed"])
    for about in (target, small_vocab_dir):  # loaded as serving would, or from the files alone
        info = describe_head(tmp_path / "s", about)
        assert info["format"] == "speculators eagle3" and info["version"] == "speculators_version 0.2.0"
        assert info["layers"] == "2" and info["fits the target"] == "yes"
        assert info["vocabulary"] == f"reduced: {len(DRAFT_IDS)} of {V} target tokens (d2t map)"
        assert "own" in info["embedding"] and "before residual" in info["norm order"]
        assert info["weights"] == "model.safetensors.index.json (2 shards)"
    write_head(tmp_path / "a", small_vocab_dir, CASES["safeailab-eagle3"])
    info = describe_head(tmp_path / "a", target)
    assert info["embedding"].startswith("the target's") and info["biases"] == "none"
    assert info["format"] == "EAGLE-3, midlayer.* layout (SafeAILab / SpecForge)" and info["weights"] == "pytorch_model.bin"


def test_our_format_round_trips_every_switch(small_vocab_dir, target, tmp_path):
    """Biases, extra layers, norm order and own embeddings survive save_head → load_head."""
    from specserve.drafters.eagle_checkpoint import save_head

    case = CASES["speculators-eagle3-2layers-nbr-own-embed"]
    write_head(tmp_path / "pub", small_vocab_dir, case)
    head = load_head(tmp_path / "pub", target)
    again = load_head(save_head(head, tmp_path / "ours"), target)
    assert (again.cfg.num_layers, again.cfg.norm_before_residual, again.cfg.own_embed) == (2, True, True)
    tokens = torch.arange(9) % V
    feats = [torch.randn(9, H, generator=torch.Generator().manual_seed(3)) for _ in head.cfg.feature_layers]
    torch.testing.assert_close(_inference_logits(again, tokens, feats), _inference_logits(head, tokens, feats))
    write_head(tmp_path / "bias", small_vocab_dir, CASES["speculators-eagle3-attention-bias"])
    bias = load_head(tmp_path / "bias", target)
    again = load_head(save_head(bias, tmp_path / "ours-bias"), target)
    assert again.cfg.qkv_bias and again.cfg.o_bias
    torch.testing.assert_close(_inference_logits(again, tokens, feats), _inference_logits(bias, tokens, feats))


@pytest.mark.parametrize("field, value, message", [
    ("norm_output", True, "norm_output=true"),
    ("fc_norm", True, "fc_norm=true"),
    ("speculators_model_type", "mlp_speculator", "speculators_model_type 'mlp_speculator'"),
    ("num_hidden_layers", 3, "num_hidden_layers=3 but the weights hold 2"),
    ("model_type", "gemma", "model_type 'gemma' is not supported"),
])
def test_unsupported_layouts_are_refused_in_one_line(small_vocab_dir, target, tmp_path, field, value, message):
    write_head(tmp_path / "h", small_vocab_dir, CASES["speculators-eagle3-2layers-nbr-own-embed"])
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    holder = config["transformer_layer_config"] if field in ("num_hidden_layers", "model_type") else config
    holder[field] = value
    (tmp_path / "h" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as err:
        load_head(tmp_path / "h", target)
    assert "\n" not in str(err.value) and "config.json" in str(err.value)


def test_a_missing_shard_is_named(small_vocab_dir, target, tmp_path):
    write_head(tmp_path / "h", small_vocab_dir, CASES["speculators-eagle3-2layers-nbr-own-embed"])
    (tmp_path / "h" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_head(tmp_path / "h", target)
