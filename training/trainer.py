"""The training loop shared by LM and draft-model training.

One loop: AdamW with warm-up + cosine decay, gradient clipping, bf16 autocast on CUDA, torch's
DistributedDataParallel when launched by ``torchrun`` (WORLD_SIZE > 1), a tqdm bar with loss and
tokens/s, ``train_log.jsonl`` lines (step, loss, lr, tokens, tokens_per_s, and eval metrics at eval
steps), resumable checkpoints written atomically every ``checkpoint_every`` steps, and a wall-clock
budget after which it stops cleanly. Ctrl-C saves a checkpoint at the last finished step first.

What it trains is the caller's business: ``batch_fn(step, rank, world)`` gives this rank's share of the
global batch of ``step`` (a pure function of the step, so resuming needs no data-loader state),
``loss_fn(model, batch)`` gives a scalar loss and ``eval_fn(model)`` a dict with ``eval_loss``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from specserve.training.presets import TrainSettings
from torch import nn

CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_FILE = "state.pt"
LOG_FILE = "train_log.jsonl"


@dataclass(frozen=True)
class DistInfo:
    """Where this process trains: its rank among ``world`` processes and its device."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str = "auto") -> DistInfo:
    """Single process, or the process group torchrun describes (nccl on CUDA, gloo on CPU)."""
    from specserve.device import resolve_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo(0, 1, 0, resolve_device(device))
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev)


def barrier(info: DistInfo) -> None:
    if info.world > 1:
        import torch.distributed as dist

        dist.barrier()


def teardown_distributed(info: DistInfo) -> None:
    if info.world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class Trainer:
    """Runs ``settings.max_steps`` optimiser steps of ``model`` and writes logs and checkpoints to ``out_dir``.

    run_key: what must not change between a checkpoint and its resumption (model shape, batch shape...);
    a mismatch on resume is a ValueError.
    """

    def __init__(
        self,
        model: nn.Module,
        settings: TrainSettings,
        out_dir: Path,
        *,
        dist: DistInfo,
        batch_fn: Callable[[int, int, int], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        eval_fn: Callable[[nn.Module], dict[str, float]],
        tokens_per_step: int,
        run_key: dict,
        desc: str = "train",
    ) -> None:
        if settings.batch_size % dist.world:
            raise ValueError(f"batch_size {settings.batch_size} must be divisible by the number of processes {dist.world}")
        self.settings = settings
        self.out_dir = Path(out_dir)
        self.dist = dist
        self.batch_fn, self.loss_fn, self.eval_fn = batch_fn, loss_fn, eval_fn
        self.tokens_per_step = tokens_per_step
        self.run_key = json.loads(json.dumps(run_key))
        self.desc = desc
        self.model = model.to(dist.device)
        self.module = model
        if dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [dist.device.index] if dist.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.model, device_ids=device_ids)
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=settings.lr,
            betas=(0.9, settings.beta2),
            fused=dist.device.type == "cuda",
        )
        self.step = 0
        self.tokens = 0
        self.train_seconds = 0.0
        self.last_eval: dict[str, float] = {}
        self.evaluated_step: int | None = None  # the step this process last evaluated at (None: not yet)
        self._saved_step = -1

    # ---- checkpoints ----------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / CHECKPOINT_DIR / CHECKPOINT_FILE

    def save_checkpoint(self) -> None:
        """Write model, optimiser and counters atomically (main rank); other ranks wait."""
        if self.dist.is_main and self._saved_step != self.step:
            path = self.checkpoint_path
            path.parent.mkdir(parents=True, exist_ok=True)
            state = {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "tokens": self.tokens,
                "train_seconds": self.train_seconds,
                "last_eval": self.last_eval,
                "run_key": self.run_key,
                "torch_rng": torch.get_rng_state(),
            }
            tmp = path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)
        self._saved_step = self.step
        barrier(self.dist)

    def load_checkpoint(self) -> None:
        path = self.checkpoint_path
        if not path.is_file():
            raise ValueError(f"--resume: no checkpoint at {str(path)!r}")
        state = torch.load(path, map_location=self.dist.device, weights_only=True)
        if state["run_key"] != self.run_key:
            diff = sorted(k for k in set(state["run_key"]) | set(self.run_key) if state["run_key"].get(k) != self.run_key.get(k))
            raise ValueError(f"--resume: the checkpoint in {str(self.out_dir)!r} was made with different {', '.join(diff)}")
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.train_seconds = float(state["train_seconds"])
        self.last_eval = dict(state["last_eval"])
        torch.set_rng_state(state["torch_rng"].cpu())
        self._saved_step = self.step
        if self.dist.is_main:
            _truncate_log(self.out_dir / LOG_FILE, self.step)

    # ---- the loop -------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        self.module.eval()
        with torch.no_grad(), self._autocast():
            metrics = {k: float(v) for k, v in self.eval_fn(self.module).items()}
        self.module.train()
        self.last_eval = metrics
        self.evaluated_step = self.step
        return metrics

    def log_evaluation(self) -> dict[str, float]:
        """Evaluate now and append the record to the log (a run that ended without evaluating its last step, e.g.
        stopped right after a log record, or resumed when already finished); return the metrics."""
        record = {"step": self.step, "tokens": self.tokens, "elapsed_s": round(self.train_seconds, 2)}
        record.update({k: round(v, 5) for k, v in self.evaluate().items()})
        with open(self.out_dir / LOG_FILE, "a") as log:
            log.write(json.dumps(record) + "\n")
        return self.last_eval

    def _autocast(self):
        if self.dist.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def run(self, resume: bool = False, stop_at_step: int | None = None) -> dict:
        """Train until max_steps, the budget, or ``stop_at_step``; return a summary dict.

        The summary's ``stopped`` is "complete", "budget" or "stop_at_step".
        """
        from tqdm import tqdm

        s = self.settings
        if resume:
            self.load_checkpoint()
        self.module.train()
        start_time = time.perf_counter()
        budget_s = s.max_minutes * 60.0
        stopped = "complete"
        log = open(self.out_dir / LOG_FILE, "a") if self.dist.is_main else None
        bar = tqdm(total=s.max_steps, initial=self.step, desc=self.desc, unit="step", dynamic_ncols=True,
                   disable=not self.dist.is_main, file=sys.stderr, mininterval=1.0)
        window = {"loss": torch.zeros((), device=self.dist.device), "steps": 0, "tokens": 0, "start": time.perf_counter()}

        def flush(lr: float, evaluate: bool) -> None:
            """Write one log record for the steps since the last one (all ranks take part)."""
            if window["steps"] == 0:
                return
            mean_loss = self._mean(window["loss"] / window["steps"])
            tok_s = window["tokens"] / max(time.perf_counter() - window["start"], 1e-9)
            record = {"step": self.step, "loss": round(mean_loss, 5), "lr": lr, "tokens": self.tokens,
                      "tokens_per_s": round(tok_s, 1), "elapsed_s": round(self.train_seconds, 2)}
            if evaluate:
                if self.dist.is_main:
                    record.update({k: round(v, 5) for k, v in self.evaluate().items()})
                barrier(self.dist)
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()
            bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}",
                            **({"eval": f"{record['eval_loss']:.3f}"} if "eval_loss" in record else {}))
            window.update(loss=torch.zeros((), device=self.dist.device), steps=0, tokens=0, start=time.perf_counter())

        lr = s.lr_at(self.step)
        try:
            while self.step < s.max_steps:
                if self._should_stop(time.perf_counter() - start_time >= budget_s):
                    stopped = "budget"
                    break
                if stop_at_step is not None and self.step >= stop_at_step:
                    stopped = "stop_at_step"
                    break
                step_start = time.perf_counter()
                lr = s.lr_at(self.step)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                batch = self.batch_fn(self.step, self.dist.rank, self.dist.world)
                with self._autocast():
                    loss = self.loss_fn(self.model, batch)
                if not torch.isfinite(loss):
                    raise ValueError(f"the loss became {float(loss)} at step {self.step}: training diverged, lower --lr")
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), s.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                self.tokens += self.tokens_per_step
                window["loss"] += loss.detach()
                window["steps"] += 1
                window["tokens"] += self.tokens_per_step
                self.train_seconds += time.perf_counter() - step_start
                bar.update(1)
                last = self.step == s.max_steps
                if self.step % s.log_every == 0 or last:
                    flush(lr, evaluate=self.step % s.eval_every == 0 or last)
                if self.step % s.checkpoint_every == 0:
                    self.save_checkpoint()
            if stopped != "complete":
                flush(lr, evaluate=True)  # a clean early stop still gets its record and a held-out loss
        except KeyboardInterrupt:
            bar.close()
            self.save_checkpoint()  # the state after the last finished step is consistent
            raise
        finally:
            bar.close()
            if log is not None:
                log.close()
        self.save_checkpoint()
        return {"step": self.step, "max_steps": s.max_steps, "tokens": self.tokens, "stopped": stopped,
                "train_seconds": round(self.train_seconds, 2), "last_eval": self.last_eval,
                "settings": asdict(s), "world_size": self.dist.world}

    def _should_stop(self, local: bool) -> bool:
        """Every rank stops at the same step: the main rank's decision is broadcast."""
        if self.dist.world == 1:
            return local
        import torch.distributed as dist

        flag = torch.tensor([1.0 if local else 0.0], device=self.dist.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _mean(self, value: torch.Tensor) -> float:
        if self.dist.world > 1:
            import torch.distributed as dist

            value = value.clone()
            dist.all_reduce(value)
            value /= self.dist.world
        return float(value)


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint being resumed (that work is redone)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))


def read_log(path: Path) -> list[dict]:
    """The records of a ``train_log.jsonl``."""
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
