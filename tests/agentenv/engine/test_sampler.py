"""The vectorized sampler: right distribution, SGLang's filters and logprobs, and draws that
depend only on (seed, token index) -- not on the batch around a request."""

from __future__ import annotations

import math

import pytest
import torch

from agentenv import SamplingParams
from agentenv.engine._sampler import SampleRow, sample, uniform

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _rows(n: int, params: SamplingParams, counter: int = 0) -> list[SampleRow]:
    return [SampleRow(params, seed, counter) for seed in range(n)]


def _frequencies(params: SamplingParams, n: int = 20000) -> torch.Tensor:
    ids, _ = sample(LOGITS.expand(n, -1).clone(), _rows(n, params))
    return torch.bincount(torch.tensor(ids), minlength=LOGITS.numel()).float() / n


def test_draws_follow_the_softmax() -> None:
    freq = _frequencies(SamplingParams(temperature=1.0))
    expected = torch.softmax(LOGITS, dim=0)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)
    hot = _frequencies(SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(LOGITS / 2, dim=0), atol=0.015)


def test_filters_restrict_the_support_and_renormalize() -> None:
    probs = torch.softmax(LOGITS, dim=0)
    top_k = _frequencies(SamplingParams(temperature=1.0, top_k=2))
    assert top_k[2:].sum() == 0
    assert torch.allclose(top_k[:2], probs[:2] / probs[:2].sum(), atol=0.015)
    # top_p 0.8: tokens are kept while the ones before them hold less than 0.8.
    cum = torch.cumsum(probs, 0)
    kept = int((cum - probs < 0.8).sum())
    top_p = _frequencies(SamplingParams(temperature=1.0, top_p=0.8))
    assert top_p[kept:].sum() == 0 and (top_p[:kept] > 0).all()
    min_p = _frequencies(SamplingParams(temperature=1.0, min_p=0.3))
    allowed = probs >= probs.max() * 0.3
    assert min_p[~allowed].sum() == 0 and (min_p[allowed] > 0).all()


def test_logprobs_are_before_filtering_and_greedy_is_argmax() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=1),
        SamplingParams(temperature=0.5, top_k=3, top_p=0.9),
    ]
    logits = LOGITS.expand(3, -1).clone()
    ids, lps = sample(logits, [SampleRow(p, 7, 0) for p in params])
    assert ids[0] == ids[1] == 0
    assert lps[0] == pytest.approx(float(torch.log_softmax(LOGITS, 0)[0]), abs=1e-6)
    assert lps[1] == pytest.approx(float(torch.log_softmax(LOGITS / 0.5, 0)[0]), abs=1e-6)
    assert ids[2] in (0, 1, 2)
    assert lps[2] == pytest.approx(float(torch.log_softmax(LOGITS / 0.5, 0)[ids[2]]), abs=1e-6)


def test_banned_tokens_are_never_drawn() -> None:
    params = SamplingParams(temperature=1.0)
    rows = [SampleRow(params, seed, 0, banned=(0, 1)) for seed in range(2000)]
    ids, lps = sample(LOGITS.expand(2000, -1).clone(), rows)
    assert 0 not in ids and 1 not in ids
    assert all(math.isfinite(lp) for lp in lps)


def test_a_draw_depends_on_seed_and_index_only() -> None:
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    alone = [sample(logits[i : i + 1], [SampleRow(params, 100 + i, 5)])[0][0] for i in range(64)]
    batched, _ = sample(logits, [SampleRow(params, 100 + i, 5) for i in range(64)])
    assert batched == alone
    other_index, _ = sample(logits, [SampleRow(params, 100 + i, 6) for i in range(64)])
    assert other_index != batched


def test_uniform_draws_are_uniform_in_range_and_the_same_as_ever() -> None:
    # Seeded runs draw what they drew before (the values of the first implementation).
    keys = [(0, 0), (1, 5), (12345, 3), (2**62 + 7, 1000), (2**63 - 1, 2**40)]
    assert [uniform(s, c) for s, c in keys] == [
        0.7237931361084726, 0.9842755529332301, 0.23110204885814056, 0.4540087165254292,
        0.07069623981148254,
    ]  # fmt: skip
    u = torch.tensor([uniform(s, 0) for s in range(50000)], dtype=torch.float64)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / 50000
    assert torch.allclose(hist, torch.full((10,), 0.1), atol=0.01)


def test_a_draw_at_the_very_top_still_picks_a_possible_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import agentenv.engine._sampler as sampler

    top = 1.0 - 2.0**-48  # the largest draw uniform() can return
    monkeypatch.setattr(sampler, "uniform", lambda s, c: top)
    logits = torch.full((1, 1000), -1e9)
    logits[0, :10] = 0.0  # only the first 10 tokens are possible
    ids, lps = sample(logits, [SampleRow(SamplingParams(temperature=1.0), 0, 0)])
    assert ids[0] < 10 and math.isfinite(lps[0])
    ids, _ = sample(logits, [SampleRow(SamplingParams(temperature=1.0, top_k=3), 0, 0)])
    assert ids[0] < 10


def test_a_top_p_too_small_for_float32_keeps_the_likeliest_token() -> None:
    # 1e-300 is 0 in float32: the filter dropped every token, and the draw fell on the
    # last id. The likeliest token always stays, so a tiny top_p is greedy.
    freq = _frequencies(SamplingParams(temperature=1.0, top_p=1e-300), n=2000)
    assert freq[0] == 1.0, freq
    freq = _frequencies(SamplingParams(temperature=1.0, top_p=1e-300, min_p=1.0), n=2000)
    assert freq[0] == 1.0, freq
