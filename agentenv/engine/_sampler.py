"""Token sampling for a batch of requests with different parameters, as SGLang does it.

The log-probability reported for a token is ``log_softmax(logits / temperature)`` after
penalties (``min_new_tokens`` forbidding the stop tokens) and *before* top-k, top-p and
min-p filtering. A temperature below 1e-6 means greedy: temperature 1 and top-k 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentenv._generator import SamplingParams

__all__ = ["sample"]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    banned: Sequence[Sequence[int]],
) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` [B, V] (float32); return ids and logprobs.

    ``banned[i]``: token ids row ``i`` may not produce yet (``min_new_tokens``).
    """
    b = logits.shape[0]
    temps = torch.tensor(
        [1.0 if p.greedy else p.temperature for p in params], device=logits.device
    ).unsqueeze(1)
    scaled = logits / temps
    for i, ids in enumerate(banned):
        if ids:
            scaled[i, list(ids)] = float("-inf")
    logprobs = torch.log_softmax(scaled, dim=-1)
    greedy = [p.greedy or p.top_k == 1 for p in params]
    filtered = logprobs
    if any(p.top_k > 1 for p in params):
        filtered = filtered.clone()
        for i, p in enumerate(params):
            if p.top_k > 1 and p.top_k < filtered.shape[1]:
                kth = torch.topk(filtered[i], p.top_k).values[-1]
                filtered[i][filtered[i] < kth] = float("-inf")
    if any(p.top_p < 1.0 for p in params):
        if filtered is logprobs:
            filtered = filtered.clone()
        rows = [i for i, p in enumerate(params) if p.top_p < 1.0 and not greedy[i]]
        if rows:
            sub = filtered[rows]
            sorted_lp, order = torch.sort(sub, dim=-1, descending=True)
            cum = torch.cumsum(sorted_lp.exp(), dim=-1)
            top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device)
            # Drop a token when the tokens before it already reach top_p (keep >= 1).
            drop = (cum - sorted_lp.exp()) >= top_p.unsqueeze(1)
            sorted_lp[drop] = float("-inf")
            filtered[rows] = torch.empty_like(sub).scatter_(1, order, sorted_lp)
    if any(p.min_p > 0.0 for p in params):
        if filtered is logprobs:
            filtered = filtered.clone()
        for i, p in enumerate(params):
            if p.min_p > 0.0 and not greedy[i]:
                row = filtered[i]
                row[row < row.max() + torch.log(torch.tensor(p.min_p))] = float("-inf")
    chosen: list[int] = []
    for i in range(b):
        if greedy[i]:
            chosen.append(int(torch.argmax(filtered[i])))
        else:
            probs = torch.softmax(filtered[i], dim=-1)
            chosen.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    picked = logprobs[torch.arange(b), torch.tensor(chosen)].tolist()
    return chosen, picked
