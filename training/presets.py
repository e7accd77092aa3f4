"""Model shapes and training settings: the named presets and their validation.

LM presets (``specserve train lm --preset``):

- ``tiny``  1.05M parameters, context 256; 400 steps of 16 x 256 tokens (~2.5 minutes on 2 idle CPU
  cores, ~12k tokens/s). The test fixture.
- ``small`` 9.1M parameters, context 512; 1000 steps of 8 x 512 tokens (4.1M tokens, ~1.6 epochs of
  the stdlib; ~35 minutes at the ~2,000 tokens/s two idle cores give). The default (bundled) model and
  the benchmark target. Tokens seen, not parameters, limit quality on CPU: a bigger model would see
  fewer tokens in the same 45 minutes. See training/README.md for measured figures.

Draft presets (``specserve train draft --preset``): ``draft`` for the small target (about a fifth of
its per-token cost), ``tiny`` for tests. A draft's vocabulary and context length come from its target.

Step counts are fixed per preset so the learning-rate schedule, and with it the run, is deterministic;
the wall-clock budget (``max_minutes``) is a safety stop that saves a resumable checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class ModelShape:
    """A Llama decoder's shape. ``vocab_size``/``max_positions`` of 0 mean "decided later" (tokenizer, target)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 0
    max_positions: int = 0
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    def validate(self) -> "ModelShape":
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            check_int(name, getattr(self, name), 1, 1 << 16)
        check_int("vocab_size", self.vocab_size, 0, 1 << 20)
        check_int("max_positions", self.max_positions, 0, 1 << 20)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head_dim {self.hidden_size // self.num_heads} must be even (RoPE)")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        return self

    def num_params(self) -> int:
        """Parameter count of the Llama model this shape describes (tied embeddings counted once)."""
        h, hd = self.hidden_size, self.hidden_size // self.num_heads
        attn = h * h * 2 + 2 * h * self.num_kv_heads * hd
        per_layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def llama_config(self, eos_token_id: int):
        """A transformers `LlamaConfig` of this shape (vocab_size and max_positions must be set)."""
        from transformers import LlamaConfig

        if self.vocab_size < 1 or self.max_positions < 2:
            raise ValueError("vocab_size and max_positions must be set before building a model")
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_positions,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=0.02,
            rms_norm_eps=1e-5,
            bos_token_id=None,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation and bookkeeping of one run.

    batch_size: sequences per optimiser step over all ranks; seq_len: tokens per sequence.
    lr: peak learning rate after ``warmup_steps`` of linear warm-up; cosine decay to
    ``lr * min_lr_ratio`` at ``max_steps``. ``eval_every``/``log_every``/``checkpoint_every`` are in steps.
    max_minutes: wall-clock budget; the run stops cleanly (checkpoint + model) when it is spent.
    """

    seq_len: int
    batch_size: int
    lr: float
    max_steps: int
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta2: float = 0.95
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    max_minutes: float = 45.0
    seed: int = 0

    def validate(self) -> "TrainSettings":
        check_int("seq_len", self.seq_len, 8, 1 << 16)
        check_int("batch_size", self.batch_size, 1, 1 << 16)
        check_int("max_steps", self.max_steps, 1, 1 << 30)
        check_int("warmup_steps", self.warmup_steps, 0, 1 << 30)
        for name in ("log_every", "eval_every", "eval_batches", "checkpoint_every"):
            check_int(name, getattr(self, name), 1, 1 << 30)
        check_int("seed", self.seed, 0, 2**63 - 1)
        check_float("lr", self.lr, 0.0, 1.0, low_open=True)
        check_float("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_float("weight_decay", self.weight_decay, 0.0, 10.0)
        check_float("grad_clip", self.grad_clip, 0.0, 1e6, low_open=True)
        check_float("beta2", self.beta2, 0.0, 1.0, low_open=True, high_open=True)
        check_float("max_minutes", self.max_minutes, 0.0, 1e6, low_open=True)
        return self

    def lr_at(self, step: int) -> float:
        """Learning rate for optimiser step ``step`` (0-based); warm-up is capped at half the run."""
        warmup = min(self.warmup_steps, self.max_steps // 2)
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, self.max_steps - warmup))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class Preset:
    """A named recipe: model shape, training settings, and how much corpus/tokenizer data to use."""

    name: str
    shape: ModelShape
    train: TrainSettings
    vocab_size: int = 0  # tokenizer size to train (LM presets)
    corpus_max_bytes: int | None = None  # train text read (None = all)
    tokenizer_sample_bytes: int = 4 << 20  # train text the tokenizer learns from

    def with_overrides(self, **overrides) -> "Preset":
        """Replace TrainSettings fields (None values are ignored) and validate the result."""
        names = {f.name for f in fields(TrainSettings)}
        unknown = sorted(k for k in overrides if k not in names)
        if unknown:
            raise ValueError(f"unknown training setting(s) {unknown}; allowed: {sorted(names)}")
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, train=replace(self.train, **given).validate())

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> "Preset":
        """Inverse of `to_dict` (a run's recorded recipe, e.g. for ``--resume``)."""
        try:
            fields_ = dict(data)
            fields_["shape"] = ModelShape(**data["shape"]).validate()
            fields_["train"] = TrainSettings(**data["train"]).validate()
            return Preset(**fields_)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a recorded preset: {exc}") from exc


LM_PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        shape=ModelShape(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384),
        train=TrainSettings(seq_len=256, batch_size=16, lr=3e-3, max_steps=400, warmup_steps=30, log_every=10,
                            eval_every=50, eval_batches=4, checkpoint_every=50, max_minutes=4.0),
        vocab_size=2048,
        corpus_max_bytes=6 << 20,
        tokenizer_sample_bytes=1 << 20,
    ),
    "small": Preset(
        name="small",
        shape=ModelShape(hidden_size=320, num_layers=6, num_heads=5, num_kv_heads=1, intermediate_size=864),
        train=TrainSettings(seq_len=512, batch_size=8, lr=1.5e-3, max_steps=1000, warmup_steps=60, log_every=10,
                            eval_every=100, eval_batches=8, checkpoint_every=50, max_minutes=45.0),
        vocab_size=8192,
        corpus_max_bytes=None,
        tokenizer_sample_bytes=4 << 20,
    ),
}

DRAFT_PRESETS: dict[str, Preset] = {
    "draft": Preset(
        name="draft",
        shape=ModelShape(hidden_size=192, num_layers=2, num_heads=3, num_kv_heads=1, intermediate_size=512),
        train=TrainSettings(seq_len=256, batch_size=16, lr=2e-3, max_steps=1000, warmup_steps=40, log_every=10,
                            eval_every=100, eval_batches=8, checkpoint_every=100, max_minutes=25.0),
    ),
    "tiny": Preset(
        name="tiny",
        shape=ModelShape(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=192),
        train=TrainSettings(seq_len=256, batch_size=8, lr=3e-3, max_steps=100, warmup_steps=10, log_every=10,
                            eval_every=50, eval_batches=2, checkpoint_every=50, max_minutes=4.0),
    ),
}


def get_preset(name: str, kind: str = "lm") -> Preset:
    table = LM_PRESETS if kind == "lm" else DRAFT_PRESETS
    if name not in table:
        raise ValueError(f"unknown {kind} preset {name!r}; available: {sorted(table)}")
    preset = table[name]
    preset.shape.validate()
    preset.train.validate()
    return preset


def check_int(name: str, value, low: int, high: int) -> None:
    """ValueError unless ``value`` is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def check_float(name: str, value, low: float, high: float, low_open: bool = False, high_open: bool = False) -> None:
    """ValueError unless ``value`` is a finite number (not a bool) in the interval; ``*_open`` excludes an end."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be a number in {lo}{low}, {high}{hi}, got {value!r}")
