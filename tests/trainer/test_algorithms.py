"""Advantages and losses against slow, obvious reference implementations (hypothesis), the
loss's independence from packing, and bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentenv import ConfigError, SamplingParams
from trainer import (
    LossConfig,
    compute_advantages,
    kl_estimate,
    logprob_temperature,
    pack_by_tokens,
    policy_loss,
    tempered_logits,
    token_weights,
)
from trainer.algorithm._losses import gradient_without_advantage

# -- references: plain Python, one sample at a time -----------------------------------


def ref_advantages(
    rewards: list[float], groups: list[int], estimator: str, normalize_std: bool, eps: float
) -> list[float]:
    members: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups, strict=True):
        members.setdefault(g, []).append(r)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    def std(xs: list[float]) -> float:
        m = mean(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))

    out = []
    for r, g in zip(rewards, groups, strict=True):
        mine = members[g]
        if estimator == "rloo":
            out.append(r - (sum(mine) - r) / (len(mine) - 1) if len(mine) > 1 else 0.0)
        elif estimator == "grpo" and normalize_std:
            out.append((r - mean(mine)) / (std(mine) + eps))
        else:
            out.append(r - mean(mine))
    if estimator == "reinforce_plus_plus_baseline":
        s = std(out)
        out = [a / (s + eps) for a in out]
    return out


def ref_token_loss(
    logp: float, old: float, adv: float, cfg: LossConfig, ref: float | None, roll: float | None
) -> float:
    ratio = math.exp(logp - old)
    clipped_ratio = min(max(ratio, 1 - cfg.eps_clip), 1 + cfg.clip_high)
    loss = max(-adv * ratio, -adv * clipped_ratio)
    if cfg.dual_clip is not None and adv < 0:
        loss = min(loss, -adv * cfg.dual_clip)
    if cfg.use_tis:
        assert roll is not None
        loss *= min(max(math.exp(old - roll), cfg.tis_clip_low), cfg.tis_clip_high)
    if cfg.kl_coef > 0:
        assert ref is not None
        if cfg.kl_type == "k1":
            kl = logp - ref
        elif cfg.kl_type == "k2":
            kl = 0.5 * (logp - ref) ** 2
        else:
            kl = math.exp(ref - logp) - (ref - logp) - 1
            if cfg.kl_type == "low_var_kl":
                kl = min(max(kl, -10), 10)
        loss += cfg.kl_coef * kl
    return loss


# -- advantages ---------------------------------------------------------------------------

rewards_and_groups = st.integers(1, 24).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(-10, 10, allow_nan=False), min_size=n, max_size=n),
        st.lists(st.integers(0, 4), min_size=n, max_size=n),
    )
)


@settings(max_examples=300, deadline=None)
@given(
    rg=rewards_and_groups,
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"]),
    normalize_std=st.booleans(),
)
def test_advantages_match_the_reference(
    rg: tuple[list[float], list[int]], estimator: str, normalize_std: bool
) -> None:
    rewards, groups = rg
    got = compute_advantages(rewards, groups, estimator, normalize_std=normalize_std)
    want = ref_advantages(rewards, groups, estimator, normalize_std, 1e-6)
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-4)


def test_uneven_groups_use_their_own_size() -> None:
    # Group "a" lost a failed sample: its baseline is the mean of the two it has.
    adv = compute_advantages([1.0, 0.0, 1.0, 1.0, 0.0], ["a", "a", "b", "b", "b"], "dr_grpo")
    assert adv.tolist() == pytest.approx([0.5, -0.5, 1 / 3, 1 / 3, -2 / 3])


def test_a_group_of_equal_rewards_has_zero_advantage() -> None:
    adv = compute_advantages([1.0, 1.0, 1.0], ["g"] * 3, "grpo")
    assert adv.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_equal_rewards_whose_mean_rounds_still_give_exactly_zero(estimator: str) -> None:
    # 0.1 + 0.1 + 0.1 = 0.30000000000000004: the mean is not 0.1, yet the group has no
    # signal; divided by the std of that rounding its advantage would be ~1e-11, not 0.
    adv = compute_advantages([0.1, 0.1, 0.1, 1.0, 0.0], ["g"] * 3 + ["h"] * 2, estimator)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0] and adv[3] > 0 > adv[4]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"estimator": "ppo"}, "unknown advantage estimator 'ppo'; valid: grpo, dr_grpo"),
        ({"rewards": [1.0, math.nan], "groups": ["a", "a"]}, "rewards must be finite"),
        ({"rewards": [1.0], "groups": ["a", "b"]}, "1 rewards but 2 group keys"),
    ],
)
def test_bad_advantage_input(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"rewards": [1.0, 0.0], "groups": ["a", "a"], **kwargs}
    with pytest.raises(ConfigError, match=message):
        compute_advantages(args.pop("rewards"), args.pop("groups"), **args)


# -- losses ----------------------------------------------------------------------------

configs = st.builds(
    LossConfig,
    eps_clip=st.sampled_from([0.1, 0.2]),
    eps_clip_high=st.sampled_from([None, 0.28]),
    dual_clip=st.sampled_from([None, 3.0]),
    use_kl_loss=st.just(True),
    kl_loss_coef=st.sampled_from([0.0, 0.05]),
    kl_type=st.sampled_from(["k1", "k2", "k3", "low_var_kl"]),
    use_tis=st.booleans(),
)
tokens = st.lists(
    st.tuples(
        st.floats(-3, 0), st.floats(-3, 0), st.floats(-2, 2), st.floats(-3, 0), st.floats(-3, 0)
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(cfg=configs, toks=tokens, weights=st.data())
def test_policy_loss_matches_the_reference(
    cfg: LossConfig, toks: list[tuple[float, ...]], weights: st.DataObject
) -> None:
    w = weights.draw(st.lists(st.floats(0, 1), min_size=len(toks), max_size=len(toks)))
    columns = zip(*toks, strict=True)
    logp, old, adv, ref, roll = (torch.tensor(c, dtype=torch.float64) for c in columns)
    loss, sums = policy_loss(
        logp, old, adv, torch.tensor(w, dtype=torch.float64), cfg, ref_logp=ref, rollout_logp=roll
    )
    want = sum(wi * ref_token_loss(*t[:3], cfg, t[3], t[4]) for wi, t in zip(w, toks, strict=True))
    assert float(loss) == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert float(sums["weight"]) == pytest.approx(sum(w))


def test_first_step_on_fresh_data_has_ratio_one_and_no_clipping() -> None:
    logp = torch.tensor([-0.5, -1.0, -2.0], requires_grad=True)
    w = torch.tensor([0.5, 0.5, 0.0])
    loss, sums = policy_loss(
        logp, logp.detach(), torch.tensor([1.0, -1.0, 3.0]), w, LossConfig(),
        rollout_logp=logp.detach(),
    )  # fmt: skip
    assert float(sums["ratio_mean"]) == 1.0 and float(sums["clipfrac"]) == 0.0
    assert float(sums["ratio_max"]) == float(sums["ratio_min"]) == 1.0
    assert float(sums["rollout_train_logprob_abs_diff"]) == 0.0
    loss.backward()
    assert logp.grad is not None and logp.grad.tolist() == pytest.approx([-0.5, 0.5, 0.0])


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(),
        LossConfig(dual_clip=3.0, eps_clip_high=0.28),
        LossConfig(use_tis=True),
        LossConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_type="k1"),
        LossConfig(use_kl_loss=True, kl_loss_coef=0.0),  # no KL: the coefficient is 0
        LossConfig(entropy_coef=0.01),
    ],
)
def test_zero_advantages_have_a_gradient_exactly_when_the_rule_says(cfg: LossConfig) -> None:
    """The rule the loop skips steps by (``gradient_without_advantage``) against autograd:
    with every advantage 0, only the KL and entropy terms leave a gradient."""
    logp = torch.tensor([-0.5, -1.0, -2.0], dtype=torch.float64, requires_grad=True)
    entropy = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64, requires_grad=True)
    old = (logp - torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)).detach()
    loss, _ = policy_loss(
        logp, old, torch.zeros(3, dtype=torch.float64), torch.full((3,), 1 / 3), cfg,
        ref_logp=old - 0.5, rollout_logp=old + 0.1, entropy=entropy,
    )  # fmt: skip
    loss.backward()  # type: ignore[no-untyped-call]
    grads = [g for g in (logp.grad, entropy.grad) if g is not None]  # None: not in the loss
    moved = any(bool(g.abs().max() > 0) for g in grads)
    assert moved == gradient_without_advantage(cfg)


def test_kl_estimators_are_zero_on_equal_policies_and_k3_is_non_negative() -> None:
    a = torch.tensor([-0.1, -2.0, -5.0])
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        assert kl_estimate(a, a, kind).abs().max() == 0
    b = torch.tensor([-3.0, -0.5, -1.0])
    assert (kl_estimate(a, b, "k3") >= 0).all()
    assert kl_estimate(torch.tensor([-20.0]), torch.tensor([0.0]), "low_var_kl") == 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eps_clip": 0.2, "eps_clip_high": 0.1}, r"--eps-clip-high \(0.1\) must be >= --eps-clip"),
        (
            {"kl_type": "k4"},
            "--kl-loss-type: Input should be 'k1', 'k2', 'k3' or 'low_var_kl', got 'k4'",
        ),
        ({"aggregation": "mean"}, "aggregation: Input should be 'per_sample', .* got 'mean'"),
        ({"aggregation": "constant"}, "needs max_response_len"),
        ({"dual_clip": 0.5}, "--eps-clip-c: Input should be greater than 1, got 0.5"),
        (
            {"tis_clip_low": 1.0, "tis_clip_high": 0.5},
            r"--tis-clip \(0.5\) must be >= --tis-clip-low",
        ),
        ({"eps_clip": -0.1}, "--eps-clip: Input should be greater than or equal to 0, got -0.1"),
        ({"eps_clip": math.inf}, "--eps-clip: Input should be a finite number"),
    ],
)
def test_bad_loss_config(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LossConfig(**kwargs)


# -- temperature --------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_tempered_log_probs_are_the_engines(temperature: float) -> None:
    """The log-probs of ``tempered_logits`` are, bit for bit, those the engine's sampler
    reports for the tokens it draws at that temperature."""
    from agentenv.engine._sampler import SampleRow, sample

    torch.manual_seed(0)
    logits = 4 * torch.randn(6, 50)
    params = SamplingParams(temperature=temperature)
    ids, reported = sample(logits, [SampleRow(params, seed=7, counter=i) for i in range(6)])
    scaled = tempered_logits(logits, temperature)
    chosen = torch.tensor(ids)[:, None]
    picked = scaled.gather(-1, chosen)[:, 0] - torch.logsumexp(scaled, dim=-1)
    assert picked.tolist() == reported
    if temperature != 1.0:  # and at T = 1 they would be another distribution's
        plain = torch.log_softmax(logits, dim=-1).gather(-1, chosen)[:, 0]
        assert float((plain - picked).abs().max()) > 0.1


@pytest.mark.parametrize(
    ("temperature", "message"),
    [
        (0.0, r"temperature must be a finite number > 0, got 0.0 \(greedy"),
        (math.nan, "temperature must be a finite number > 0, got nan"),
    ],
)
def test_a_temperature_the_logprobs_cannot_be_taken_at_is_refused(
    temperature: float, message: str
) -> None:
    from trainer.backends._backend import check_temperature

    with pytest.raises(ConfigError, match=message):
        check_temperature(temperature)


def test_the_logprob_temperature_of_sampling() -> None:
    assert logprob_temperature(SamplingParams(temperature=0.7)) == 0.7
    assert logprob_temperature(SamplingParams(temperature=0.0)) == 1.0  # greedy: argmax
    assert "temperature" not in LossConfig.model_fields  # the rollouts' setting alone


# -- packing ------------------------------------------------------------------------------


def test_packing_respects_the_budget_and_keeps_every_sample() -> None:
    lengths = [5, 9, 3, 7, 2, 8, 1]
    bins = pack_by_tokens(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4  # 35 tokens: 4 bins of 10 is the minimum
    with pytest.raises(ConfigError, match="sample 1 has 9 tokens, more than max_tokens_per_gpu=8"):
        pack_by_tokens(lengths, 8)


@pytest.mark.parametrize("aggregation", ["per_sample", "per_token", "constant"])
def test_loss_and_gradients_do_not_depend_on_packing(aggregation: str) -> None:
    """A toy policy (each token's log-prob from the previous token); every packing of
    the same samples gives the same loss and the same gradients."""
    torch.manual_seed(0)
    vocab, dim = 11, 6
    emb = torch.nn.Embedding(vocab, dim).double()
    head = torch.nn.Linear(dim, vocab).double()
    cfg = LossConfig(
        aggregation=aggregation, max_response_len=12, use_kl_loss=True, kl_loss_coef=0.1
    )
    gen = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(9):
        n = int(torch.randint(2, 12, (1,), generator=gen))
        ids = torch.randint(0, vocab, (n + 1,), generator=gen)
        mask = (torch.rand(n, generator=gen) > 0.2).double()
        samples.append((ids, mask))
    adv = compute_advantages(torch.rand(9, generator=gen).tolist(), [0, 0, 0, 1, 1, 1, 2, 2, 2])
    total_tokens = int(sum(m.sum() for _, m in samples))
    weights = token_weights(
        [len(m) for _, m in samples], [m for _, m in samples], cfg,
        total_samples=len(samples), total_tokens=total_tokens,
    )  # fmt: skip

    def step(bins: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
        emb.zero_grad()
        head.zero_grad()
        total = 0.0
        for b in bins:
            logps, olds, advs, ws, refs = [], [], [], [], []
            for i in b:
                ids, _ = samples[i]
                lp = torch.log_softmax(head(emb(ids[:-1])), -1).gather(1, ids[1:, None])[:, 0]
                logps.append(lp)
                olds.append(lp.detach() - 0.05)
                refs.append(lp.detach() - 0.1)
                advs.append(adv[i].double().expand(len(lp)))
                ws.append(weights[i])
            loss, _ = policy_loss(
                torch.cat(logps), torch.cat(olds), torch.cat(advs), torch.cat(ws), cfg,
                ref_logp=torch.cat(refs),
            )  # fmt: skip
            loss.backward()
            total += float(loss.detach())
        return total, [p.grad.clone() for p in (*emb.parameters(), *head.parameters())]  # type: ignore[union-attr]

    lengths = [len(m) for _, m in samples]
    one_loss, one_grads = step([list(range(9))])
    for budget in (11, 16, 40):
        loss, grads = step(pack_by_tokens(lengths, budget))
        assert loss == pytest.approx(one_loss, rel=1e-12)
        for g, h in zip(grads, one_grads, strict=True):
            assert torch.allclose(g, h, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_token_logprob_matches_log_softmax_and_its_gradient(
    dtype: torch.dtype, temperature: float
) -> None:
    """The torch backend's chunked log-prob (bf16 path, hand-written backward) and its
    fp32 path give ``log_softmax(logits / T)``, its gradient and entropy."""
    from trainer.backends._torch import _token_logprobs, _TokenLogprob

    torch.manual_seed(0)
    logits = (3 * torch.randn(37, 101)).to(dtype)
    target = torch.randint(0, 101, (37,))
    weight = torch.randn(37)
    mine = logits.clone().requires_grad_(True)
    lp = _TokenLogprob.apply(mine, target, 8, temperature)  # type: ignore[no-untyped-call]
    (lp * weight).sum().backward()
    ref_in = logits.float().requires_grad_(True)
    ref = torch.log_softmax(ref_in / temperature, -1).gather(-1, target[:, None])[:, 0]
    (ref * weight).sum().backward()
    assert torch.allclose(lp, ref.detach(), atol=1e-5)
    assert mine.grad is not None and ref_in.grad is not None
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(mine.grad.float(), ref_in.grad, atol=tol)
    fp32, entropy = _token_logprobs(torch.nn.Identity(), logits, target, True, temperature)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    assert torch.allclose(fp32, ref.detach(), atol=1e-5)
    assert torch.allclose(entropy, -(probs * probs.log()).sum(-1), atol=1e-5)
