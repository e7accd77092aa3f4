"""Public Medusa checkpoints (FasterDecoding/Medusa), read from names and shapes before any tensor data.

Detected from the files (the facts behind each rule are in `inspect_public`):
``config.json`` with ``medusa_num_heads``, ``medusa_num_layers`` (default 1), ``base_model_name_or_path``
and, from the v2 trainer, ``"version": "2"``. For head k and residual block l the weights hold
``{k}.{l}.linear.weight`` [H, H] and ``{k}.{l}.linear.bias`` [H] (the state dict of a ModuleList of
``Sequential(ResBlock * num_layers[, Linear(H, V, bias=False)])``), in one of:

- Medusa-1 heads: ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``, each head also holding its
  own LM head ``{k}.{num_layers}.weight`` [V, H];
- Medusa v2 heads: ``medusa_lm_head.safetensors`` with the blocks only; every head ends in the target's
  own LM head (it is not stored with the heads);
- Medusa-2: the jointly fine-tuned target's own directory, the heads (Medusa-1 shaped) stored beside its
  weights as ``medusa_head.{k}...`` in its ``model*.safetensors`` — it loads as the target too.

A config naming fewer heads than the file holds uses the first ``medusa_num_heads``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from specserve.drafters.checkpoint_io import read_json as _read_json

PUBLIC_CONFIG = "config.json"
PUBLIC_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
PUBLIC_VERSIONS = ("1", "2")
JOINT_PREFIX = "medusa_head."  # the heads' names inside a jointly fine-tuned (Medusa-2) target's shards


@dataclass
class PublicFiles:
    """What a public Medusa directory holds, read from its config and tensor names and shapes only (no
    tensor data is read, so `describe_heads` is cheap even for 7B-sized heads).

    ``shapes`` maps head tensor names without the ``medusa_head.`` prefix (``"0.0.linear.weight"``) to
    shapes; ``read(names)`` returns those tensors.
    """

    where: Path  # the heads file, or the directory of a jointly fine-tuned model
    config: dict
    version: str | None  # the config's "version" ("2" from Medusa's v2 trainer), None when absent
    joint: bool  # heads stored inside the target's own model shards (Medusa-2)
    num_heads: int  # heads used: the config's medusa_num_heads
    file_heads: int  # heads the file holds (head indices 0 .. file_heads - 1)
    num_layers: int
    lm_head: str  # "own" (a [V, H] per head, Medusa-1 files) | "shared" (the target's, Medusa v2 files)
    hidden: int | None  # None when no tensor names it (shared LM head and no blocks): the target's
    vocab: int | None  # None with a shared LM head: the target's
    shapes: dict[str, tuple[int, ...]]
    read: Callable[[list[str]], dict[str, torch.Tensor]]

    def expected(self, hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor the used heads need (hidden/vocab: the files', else the target's)."""
        out = {}
        for k in range(self.num_heads):
            for layer in range(self.num_layers):
                out[f"{k}.{layer}.linear.weight"] = (hidden, hidden)
                out[f"{k}.{layer}.linear.bias"] = (hidden,)
            if self.lm_head == "own":
                out[f"{k}.{self.num_layers}.weight"] = (vocab, hidden)
        return out

    @property
    def label(self) -> str:
        if self.joint:
            return "Medusa-2 (FasterDecoding): a target fine-tuned jointly with its heads, medusa_head.* in its shards"
        if self.lm_head == "shared":
            return "Medusa v2 heads (FasterDecoding): residual blocks only, ending in the target's LM head"
        return "Medusa-1 heads (FasterDecoding): residual blocks and an LM head per head"


def inspect_public(path: Path) -> PublicFiles:
    """Find and check a public Medusa directory's weights from names and shapes.

    Facts from FasterDecoding/Medusa that this follows:
    - Medusa-1 (``medusa_model_legacy.py`` before v2, ``medusa_model.py``'s heads-only path): each head is
      ``Sequential(ResBlock * L, Linear(H, V, bias=False))``, saved as that ModuleList's state dict in
      ``medusa_lm_head.pt`` (or ``.safetensors``).
    - Medusa v2 (``train_legacy.py``, config ``"version": "2"``; TGI's ``MedusaHeadV2``): each head is
      ``Sequential(ResBlock * L)`` only and the logits are ``base_model.lm_head(head(h))`` — the file holds
      ``{k}.{l}.linear.weight/bias`` and no LM head; the target's own LM head is used.
    - Medusa-2 (heads trained jointly with the target; ``medusa_model.py``'s ``from_pretrained`` first
      path, ctlllll/axolotl's ``add_medusa_heads``): the fine-tuned target's directory, its config.json
      carrying ``medusa_num_heads``/``medusa_num_layers``, its shards holding ``medusa_head.{k}...``.
    - A config naming fewer heads than the file holds loads the first ``medusa_num_heads`` (the legacy
      loader's ``load_state_dict(strict=False)``; TGI's ``--speculate``). ``medusa_model.py``'s heads-only
      path instead forces 5 heads whatever the config says (a TODO about one uploaded config); the
      config is followed here, and fewer heads only ever cost speed.
    Which LM head a head ends in is read from the files, never from ``version`` alone (as TGI does: a
    Medusa-1 file relabelled with version 2 by re-saving its config still holds, and needs, its own).
    """
    config_path = path / PUBLIC_CONFIG
    config = _read_json(config_path, "Medusa config")
    num_heads, num_layers = config.get("medusa_num_heads"), config.get("medusa_num_layers", 1)
    for name, value, low in (("medusa_num_heads", num_heads, 1), ("medusa_num_layers", num_layers, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{str(config_path)!r}: {name} must be an integer >= {low}, got {value!r}")
    version = config.get("version")
    if version is not None and str(version) not in PUBLIC_VERSIONS:
        raise ValueError(f"{str(config_path)!r}: version {version!r} is not a Medusa version this specserve reads "
                         f"({', '.join(PUBLIC_VERSIONS)})")
    joint = False
    if (path / PUBLIC_WEIGHTS[0]).is_file():
        where = path / PUBLIC_WEIGHTS[0]
        shapes, read = _safetensors_index([where], joint=False)
    elif (path / PUBLIC_WEIGHTS[1]).is_file():
        where = path / PUBLIC_WEIGHTS[1]
        state = {k.removeprefix(JOINT_PREFIX): v for k, v in _read_torch_state(where).items()}
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        read = lambda names: {n: state[n] for n in names}
    else:
        from specserve.checkpoint import checkpoint_files

        try:
            files = checkpoint_files(path)
        except FileNotFoundError:
            files = []
        shapes, read = _safetensors_index(files, joint=True) if files else ({}, None)
        if not shapes:
            raise ValueError(f"{str(path)!r} has a Medusa {PUBLIC_CONFIG} but no {PUBLIC_WEIGHTS[0]}, no "
                             f"{PUBLIC_WEIGHTS[1]} and no {JOINT_PREFIX}* tensors in model safetensors")
        where, joint = path, True
    heads_seen = {int(k.split(".", 1)[0]) for k in shapes if k.split(".", 1)[0].isdigit()}
    strays = sorted(k for k in shapes if not k.split(".", 1)[0].isdigit())
    if strays:
        raise ValueError(f"medusa weights in {str(where)!r} hold tensors that are not per-head "
                         f"({JOINT_PREFIX if joint else ''}{{head}}.…): {', '.join(strays[:5])}")
    file_heads = max(heads_seen) + 1 if heads_seen else 0
    if num_heads > file_heads:
        raise ValueError(f"{str(config_path)!r}: medusa_num_heads is {num_heads} but {str(where)!r} holds "
                         f"{file_heads} head(s)")
    used = {k: s for k, s in shapes.items() if int(k.split(".", 1)[0]) < num_heads}
    has_lm = [f"{k}.{num_layers}.weight" in used for k in range(num_heads)]
    if any(has_lm) and not all(has_lm):
        raise ValueError(f"medusa weights in {str(where)!r}: heads {[k for k, h in enumerate(has_lm) if h]} have an "
                         f"LM head ({{head}}.{num_layers}.weight) and heads {[k for k, h in enumerate(has_lm) if not h]} "
                         "do not")
    lm_head = "own" if all(has_lm) else "shared"
    hidden = vocab = None
    if lm_head == "own":
        lm_shape = used[f"0.{num_layers}.weight"]
        if len(lm_shape) != 2:
            raise ValueError(f"medusa weights in {str(where)!r}: '0.{num_layers}.weight' has shape {lm_shape}, "
                             "expected [vocab, hidden]")
        vocab, hidden = lm_shape
    elif num_layers and len(used.get("0.0.linear.weight", ())) == 2:
        hidden = used["0.0.linear.weight"][1]
    return PublicFiles(where, config, None if version is None else str(version), joint, num_heads, file_heads,
                        num_layers, lm_head, hidden, vocab, used, read)


def _safetensors_index(files: list[Path], joint: bool):
    """Shapes of the head tensors in ``files`` by name less the ``medusa_head.`` prefix (which heads files
    may carry too, from the wrapper's attribute name), and a reader for them; nothing else is read.
    joint: the files are a model's shards: only ``medusa_head.*`` names are heads."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    origin: dict[str, tuple[Path, str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                    if joint and not key.startswith(JOINT_PREFIX):
                        continue
                    name = key.removeprefix(JOINT_PREFIX)
                    shapes[name] = tuple(f.get_slice(key).get_shape())
                    origin[name] = (file, key)
        except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"{str(file)!r} is not a readable safetensors file (corrupt or truncated?): {exc}") from exc

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for file in sorted({origin[n][0] for n in names}):
            with safe_open(str(file), framework="pt") as f:
                for n in names:
                    if origin[n][0] == file:
                        out[n] = f.get_tensor(origin[n][1])
        return {n: out[n] for n in names}

    return shapes, read


def _read_torch_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises assorted types for corrupt pickles
        raise ValueError(f"{str(path)!r} is not a readable torch state dict: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{str(path)!r} is not a state dict of tensors")
    return state


def check_shapes(where: Path, shapes: dict[str, tuple], expected: dict[str, tuple]) -> None:
    """The tensors' names and shapes are exactly ``expected``'s."""
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}" + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:5])}"
                         + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""))
        raise ValueError(f"medusa weights in {str(where)!r} do not match their config: {'; '.join(parts)}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"medusa weights in {str(where)!r}: {name!r} has shape {tuple(shapes[name])}, "
                             f"expected {shape}")
