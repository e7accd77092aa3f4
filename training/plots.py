"""Loss-curve plots of a run's ``train_log.jsonl`` (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import sys
from pathlib import Path


def plot_loss_curve(records: list[dict], out_path: Path, title: str, eval_key: str = "eval_loss") -> Path | None:
    """Training loss (per logged step) and held-out ``eval_key`` against tokens seen.

    Returns the path, or None without records or without matplotlib (a warning says so).
    """
    if not records:
        return None
    try:
        import matplotlib
    except ImportError:
        print(f"warning: matplotlib is not installed, so {out_path.name} is not drawn (pip install matplotlib)", file=sys.stderr)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["tokens"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["tokens"], r[eval_key]) for r in records if eval_key in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot([t / 1e6 for t, _ in train], [v for _, v in train], label="train loss", lw=1.2)
    if evals:
        ax.plot([t / 1e6 for t, _ in evals], [v for _, v in evals], "o-", label=f"held-out {eval_key}", lw=1.5, ms=4)
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path
