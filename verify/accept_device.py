"""Batched acceptance as tensor ops on an accelerator: the same algorithm as `accept_kernels`, vectorised
over the requests of a step, looping only over tree depth and sibling rank (both known on the host).

Only a few ints per request come back to the host (accepted length, path, bonus token): the target's
rows never leave the device. Used when the verify forward's logits live on a GPU; the CPU runs the
compiled `accept_kernels` (tensor ops there would cost more than the step's forward).
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.verify.packed import PackedTrees


def accept_on_device(packed: PackedTrees, greedy: np.ndarray, argmax: torch.Tensor, probs: torch.Tensor | None,
                     prob_index: np.ndarray, uniforms: np.ndarray, residual_eps: float):
    """(last accepted node int64[B] (local; -1: none), bonus token int64[B], bad node or -1), on the host.

    argmax: int64[R] on the device; probs: float32[R_s, V] on the device (None when every request is
    greedy); prob_index, uniforms: host arrays as for `accept_packed`.
    """
    device = argmax.device
    num_requests = packed.num_requests
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)  # noqa: E731
    tokens, parent_row, first_child, next_sibling = (t(a) for a in (packed.tokens, packed.parent_row,
                                                                    packed.first_child, packed.next_sibling))
    depth, cu_rows, cu_nodes = t(packed.depth), t(packed.cu_rows), t(packed.cu_nodes)
    node_row = t(packed.node_rows())
    last = torch.full((num_requests,), -1, dtype=torch.int64, device=device)  # last accepted node, local
    bonus = torch.zeros(num_requests, dtype=torch.int64, device=device)
    bad = torch.full((1,), -1, dtype=torch.int64, device=device)
    greedy_t = t(greedy.astype(np.bool_))
    num_nodes = packed.num_nodes
    request_of_node = torch.repeat_interleave(torch.arange(num_requests, device=device), cu_nodes[1:] - cu_nodes[:-1])

    if bool(greedy.any()):
        # A node is acceptable when it and every ancestor match the target's argmax; settle depth by depth.
        match = tokens == argmax[parent_row] if num_nodes else torch.zeros(0, dtype=torch.bool, device=device)
        ok = torch.zeros_like(match)
        parent_node = torch.where(parent_row > cu_rows[request_of_node], parent_row - request_of_node - 1, -1)
        for d in range(1, packed.max_depth + 1):
            at = depth == d
            parent_ok = torch.where(parent_node >= 0, ok[parent_node.clamp(min=0)], True)
            ok = torch.where(at, match & parent_ok, ok)
        local = torch.arange(num_nodes, device=device) - cu_nodes[request_of_node]
        big = num_nodes + 1
        key = torch.where(ok & greedy_t[request_of_node], depth * big + (big - 1 - local), -1)
        best_key = torch.full((num_requests,), -1, dtype=torch.int64, device=device)
        best_key.scatter_reduce_(0, request_of_node, key, reduce="amax")
        best_local = torch.where(best_key >= 0, big - 1 - best_key % big, -1)
        row = torch.where(best_local >= 0, cu_rows[:-1] + 1 + best_local, cu_rows[:-1])
        last = torch.where(greedy_t, best_local, last)
        bonus = torch.where(greedy_t, argmax[row], bonus)

    if probs is not None and not bool(greedy.all()):
        sampled = np.flatnonzero(~greedy)
        s_idx = t(sampled)
        rows_index = t(prob_index)
        u = t(uniforms)
        q_ids, q_probs = packed.q_ids.to(device), packed.q_probs.to(device, torch.float64)
        cur_row = cu_rows[:-1][s_idx]
        p = probs[rows_index[cur_row]].double()
        total = p.sum(-1)
        alive = torch.ones(len(sampled), dtype=torch.bool, device=device)
        s_last = torch.full((len(sampled),), -1, dtype=torch.int64, device=device)
        siblings = int(np.bincount(packed.parent_row, minlength=1).max()) if num_nodes else 0
        for d in range(packed.max_depth):
            node = first_child[cur_row]
            trying = alive & (node >= 0)
            chosen = torch.full_like(node, -1)
            for _ in range(siblings):
                g = node.clamp(min=0)
                x = tokens[g]
                ids = q_ids[g]  # [S, K]
                valid = ids >= 0
                qx = (q_probs[g] * (ids == x[:, None])).sum(-1)
                bad = torch.maximum(bad, torch.where(trying & ~(qx > 0), g, -1).amax().view(1))
                px = p.gather(1, x[:, None])[:, 0]
                accept = trying & (u[g] * qx * total < px)
                chosen = torch.where(accept, g, chosen)
                rejected = trying & ~accept
                before = p.gather(1, ids.clamp(min=0))
                after = (before - q_probs[g] * total[:, None]).clamp(min=0)
                delta = torch.where(valid, after - before, 0.0)
                new_total = total + delta.sum(-1)
                use_residual = rejected & (new_total > residual_eps * total)
                use_fallback = rejected & ~use_residual & (total - px > 0)
                p = p.scatter_add(1, ids.clamp(min=0), torch.where(use_residual[:, None], delta, 0.0))
                p = p.scatter_add(1, x[:, None], torch.where(use_fallback, -px, 0.0)[:, None])
                total = torch.where(use_residual, new_total, torch.where(use_fallback, total - px, total))
                nxt = next_sibling[g]
                trying = rejected & (nxt >= 0)
                node = torch.where(rejected, nxt, node)
            accepted = chosen >= 0
            s_last = torch.where(accepted, chosen - cu_nodes[:-1][s_idx], s_last)
            alive &= accepted
            cur_row = torch.where(accepted, node_row[chosen.clamp(min=0)], cur_row)
            fresh = probs[rows_index[cur_row]].double()
            p = torch.where(accepted[:, None], fresh, p)
            total = torch.where(accepted, fresh.sum(-1), total)
        # The bonus token: inverse CDF of the residual, never a zero-probability token.
        cdf = p.cumsum(-1)
        target = u[num_nodes + s_idx] * total
        pick = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp(max=p.shape[1] - 1)
        last_nonzero = (p > 0).long().cumsum(-1).argmax(-1)
        pick = torch.where(p.gather(1, pick[:, None])[:, 0] > 0, pick, last_nonzero)
        last[s_idx] = s_last
        bonus[s_idx] = pick
    out = torch.cat([last, bonus, bad]).cpu().numpy()  # the one transfer: two ints per request
    return out[:num_requests], out[num_requests:2 * num_requests], int(out[-1])
