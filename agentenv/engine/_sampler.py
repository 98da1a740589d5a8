"""Token sampling for a batch of requests with different parameters, as SGLang does it.

The log-probability reported for a token is ``log_softmax(logits / temperature)`` after
penalties (``min_new_tokens`` forbidding the stop tokens) and *before* top-k, top-p and
min-p filtering. A temperature below 1e-6 means greedy: temperature 1 and top-k 1.

Sampling is one vectorized pass for the whole batch (inverse CDF: the first token whose
cumulative probability exceeds a uniform draw). The draw comes from a counter-based hash of
``(seed, index of the token in the completion)``, so a seeded request draws the same tokens
whatever else is in the batch, on any device, with no per-request random-generator state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from agentenv._generator import SamplingParams

__all__ = ["SampleRow", "sample", "uniform"]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: a product with a 32-bit value stays well inside int64


def _mix(x: int) -> int:
    """A 32-bit integer hash (full avalanche) of a value < 2**32."""
    x ^= x >> 16
    x = (x * _MUL) & _M32
    x ^= x >> 16
    x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def uniform(seed: int, counter: int) -> float:
    """A float in [0, 1) (48 random bits), a pure function of ``seed`` (0 <= seed < 2**63)
    and ``counter`` (>= 0). Computed on the host: a batch's draws are a few microseconds
    of Python, where the same hash as tensor operations was ~60 kernel launches a step."""
    key = _mix(_mix((seed & _M32) ^ _mix((seed >> 32) & _M32)) ^ (counter & _M32))
    high = _mix(key ^ 0x9E3779B9) >> 8  # 24 bits each
    low = _mix(key ^ 0x7F4A7C15) >> 8
    return (high * (1 << 24) + low) * (1.0 / (1 << 48))  # exact: an integer < 2**48


@dataclasses.dataclass(frozen=True, slots=True)
class SampleRow:
    """What sampling needs to know of one request."""

    params: SamplingParams
    seed: int  # 0 <= seed < 2**63
    counter: int  # the index of the token being drawn in the completion
    banned: Sequence[int] = ()  # ids this row may not produce yet (min_new_tokens)


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` [B, V] (float32); return ids and logprobs."""
    b, vocab = logits.shape
    device = logits.device
    params = [r.params for r in rows]
    greedy = [p.greedy or p.top_k == 1 for p in params]
    if all(p.temperature == 1.0 or p.greedy for p in params):
        scaled = logits
    else:
        temps = [1.0 if p.greedy else p.temperature for p in params]
        scaled = logits / torch.tensor(temps, device=device).unsqueeze(1)
    if any(r.banned for r in rows):
        if scaled is logits:
            scaled = logits.clone()
        for i, r in enumerate(rows):
            if r.banned:
                scaled[i, list(r.banned)] = float("-inf")
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    sampled = [i for i in range(b) if not greedy[i]]
    whole = len(sampled) == b
    # The greedy rows' picks (none when every row samples: the draws are all of them).
    chosen = scaled.new_empty(0, dtype=torch.long) if whole else torch.argmax(scaled, dim=-1)
    if sampled:
        probs = torch.exp(scaled - lse) if whole else torch.exp(scaled[sampled] - lse[sampled])
        filtering = [
            i
            for i, k in enumerate(sampled)
            if 1 < params[k].top_k < vocab or params[k].top_p < 1.0 or params[k].min_p > 0.0
        ]
        if filtering:
            probs = _filtered(probs, [params[sampled[i]] for i in filtering], filtering)
        # In float64: in float32 a running sum past ~0.5 would swallow tokens of
        # probability below ~3e-8, which then could never be drawn.
        cdf = torch.cumsum(probs.double(), dim=-1)
        draws = [uniform(rows[i].seed, rows[i].counter) for i in sampled]
        u = torch.tensor(draws, dtype=torch.float64).to(device, non_blocking=True)
        total = cdf[:, -1]
        draw = torch.minimum(u * total, torch.nextafter(total, total * 0))
        # The first token whose cumulative probability exceeds the draw: never one of
        # probability zero, since the draw stays below the total.
        picks = torch.searchsorted(cdf, draw.unsqueeze(1), right=True).squeeze(1)
        picks = picks.clamp_(max=vocab - 1)
        if whole:
            chosen = picks
        else:
            chosen[sampled] = picks
    picked = (scaled.gather(1, chosen.unsqueeze(1)) - lse).squeeze(1)
    # One copy back (ids below 2**53 and float32 log-probs are exact in float64).
    ids, lps = torch.stack((chosen.to(torch.float64), picked.to(torch.float64))).tolist()
    return [int(t) for t in ids], lps


def _filtered(probs: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> torch.Tensor:
    """``probs`` with the tokens that top-k, top-p and min-p exclude set to 0 (for
    ``rows`` only, whose parameters are ``params``)."""
    device = probs.device
    sub = probs[rows]
    sorted_p, order = torch.sort(sub, dim=-1, descending=True)
    vocab = sub.shape[1]
    rank = torch.arange(vocab, device=device).unsqueeze(0)
    k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
    drop = rank >= k.unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    # Drop a token when the tokens before it already reach top_p (the first always stays).
    drop |= (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p
    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    drop |= sorted_p < sorted_p[:, :1] * min_p
    # The likeliest token always stays: a top_p that is 0 in float32 (1e-300) would
    # otherwise drop every token, and the draw fall on the last id.
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = probs.clone()
    out[rows] = torch.empty_like(sub).scatter_(1, order, sorted_p)
    return out
