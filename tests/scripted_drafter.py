"""A test drafter whose trees come from a recipe: right, wrong, random, deep or wide, with or without q.

It knows the plain-decoding reference continuation of each prompt, so it can propose trees that are
entirely right, entirely wrong, or anything between — the adversarial inputs losslessness must survive.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.drafters.base import Drafter, TargetInfo, register
from specserve.verify import DraftTree

MODES = ("random", "all_right", "all_wrong", "mixed", "deep_chain", "wide_fan")


@register("scripted")
class ScriptedDrafter(Drafter):
    def __init__(self, target: TargetInfo, path=None, *, mode: str = "mixed", seed: int = 0, references=(),
                 max_budget: int = 12, with_probs: bool = False) -> None:
        assert mode in MODES, mode
        self.vocab = target.vocab_size
        self.mode = mode
        self.rng = np.random.default_rng(seed)
        self.references = [list(r) for r in references]  # prompt + plain greedy output, per prompt
        self.max_budget = max_budget
        self.with_probs = with_probs
        self.gives_probs = with_probs

    def _right_token(self, context: list[int], path_tokens: list[int]) -> int | None:
        full = context + path_tokens
        for ref in self.references:
            if len(ref) > len(full) and ref[: len(full)] == full:
                return ref[len(full)]
        return None

    def _token(self, context, path_tokens, want_right: bool) -> int:
        right = self._right_token(context, path_tokens)
        if want_right and right is not None:
            return right
        tok = int(self.rng.integers(self.vocab))
        if not want_right and right is not None and tok == right:
            tok = (tok + 1) % self.vocab
        return tok

    def propose(self, requests, budgets, depth=None):
        trees = []
        for req, budget in zip(requests, budgets):
            context = req.token_ids.tolist()
            n = int(self.rng.integers(0, budget + 1)) if self.mode in ("random", "mixed") else budget
            parents, tokens, paths, qs = [], [], [], []
            for i in range(n):
                if self.mode in ("deep_chain", "all_right", "all_wrong"):
                    parent = i - 1
                elif self.mode == "wide_fan":
                    parent = -1 if i < max(1, n // 2) else int(self.rng.integers(-1, i))
                else:
                    parent = int(self.rng.integers(-1, i))
                path = [] if parent == -1 else paths[parent]
                want_right = {"all_right": True, "all_wrong": False}.get(self.mode, bool(self.rng.random() < 0.6))
                if self.mode == "deep_chain":
                    want_right = bool(self.rng.random() < 0.8)
                if self.with_probs:
                    # Lossless sampling needs tokens really drawn from q: draw each node from its own
                    # random q (leaning towards the right token, so drafts are often accepted).
                    q = self.rng.dirichlet(np.ones(self.vocab))
                    right = self._right_token(context, path)
                    if right is not None and want_right:
                        q[right] += 1.0
                    q /= q.sum()
                    tok = int(self.rng.choice(self.vocab, p=q))
                    qs.append(q)
                else:
                    tok = self._token(context, path, want_right)
                parents.append(parent)
                tokens.append(tok)
                paths.append(path + [tok])
            probs = torch.tensor(np.array(qs), dtype=torch.float32) if self.with_probs and n else None
            trees.append(DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64), probs))
        return trees
