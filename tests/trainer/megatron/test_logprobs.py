"""Vocabulary padding is masked out of the softmax: sharded and masked, the log-probs are
those of the unpadded HF vocabulary; they and the entropies are at the rollout's
temperature."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trainer.megatron import mask_vocab_padding


def test_masked_shards_give_the_unpadded_log_softmax() -> None:
    torch.manual_seed(0)
    vocab, padded, tp = 100, 128, 4
    logits = torch.randn(3, 5, padded)
    target = torch.randint(0, vocab, (3, 5))
    shards = [mask_vocab_padding(part, vocab, r) for r, part in enumerate(logits.chunk(tp, dim=-1))]
    assert torch.isinf(shards[-1][..., vocab % 32 :]).all() and torch.isfinite(shards[0]).all()
    # What vocab_parallel_cross_entropy computes from the shards, done in one place.
    logp = torch.log_softmax(torch.cat(shards, dim=-1), dim=-1).gather(-1, target[..., None])
    want = torch.log_softmax(logits[..., :vocab], dim=-1).gather(-1, target[..., None])
    assert torch.allclose(logp, want, atol=1e-6)


def test_masking_leaves_the_input_alone() -> None:
    logits = torch.zeros(2, 64)
    out = mask_vocab_padding(logits, 100, 1)  # rank 1 holds ids 64..127: 100.. are padding
    assert torch.isinf(out[:, 36:]).all() and (out[:, :36] == 0).all()
    assert (logits == 0).all()
    assert mask_vocab_padding(logits, 100, 0) is not logits


class _StandInCore:
    """What the log-prob functions use of ``megatron.core``, for one tensor-parallel rank
    on CPU: the cross entropy over the whole (masked) vocabulary, reductions that are the
    identity."""

    class parallel_state:  # megatron's module names
        @staticmethod
        def get_tensor_model_parallel_rank() -> int:
            return 0

        @staticmethod
        def get_tensor_model_parallel_group() -> Any:
            return SimpleNamespace(size=lambda: 1)

    class tensor_parallel:
        @staticmethod
        def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> Any:
            picked = logits.gather(-1, target[..., None])[..., 0]
            return torch.logsumexp(logits, dim=-1) - picked

        @staticmethod
        def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
            return x


def test_the_backend_takes_log_probs_and_entropy_at_the_rollout_temperature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The megatron backend's per-item outputs, from padded vocab-parallel logits (one
    rank), are the log-probs and entropies of ``softmax(logits[:V] / T)``: the
    distribution the rollout engine sampled from at temperature T."""
    import trainer.megatron._provider as provider
    from trainer import LossConfig
    from trainer.backends._backend import Item
    from trainer.megatron import MegatronWorker

    monkeypatch.setattr(provider, "require_megatron", lambda module="": _StandInCore)
    torch.manual_seed(0)
    vocab, padded, t = 40, 48, 0.7
    batch = [
        Item(torch.tensor([1, 5, 7, 9]), 2, torch.ones(2, dtype=torch.float64)),
        Item(torch.tensor([3, 4, 8]), 1, torch.ones(2, dtype=torch.float64)),
    ]
    logits = 5 * torch.randn(2, 4, padded)
    me = SimpleNamespace(
        loss_config=LossConfig(entropy_coef=0.1),
        cfg=SimpleNamespace(vocab_size=vocab), device=torch.device("cpu"), tp_rank=0,
        qkv_format="bshd",
    )  # fmt: skip
    logps, ents = MegatronWorker._outputs(me, batch, logits, with_entropy=True, temperature=t)  # type: ignore[arg-type]
    assert ents is not None
    for row, (it, lp, ent) in enumerate(zip(batch, logps, ents, strict=True)):
        cols = torch.arange(it.start - 1, len(it.ids) - 1)
        want = torch.log_softmax(logits[row, cols, :vocab] / t, dim=-1)
        assert torch.allclose(lp, want.gather(-1, it.ids[it.start :, None])[:, 0], atol=1e-6)
        assert torch.allclose(ent, -(want.exp() * want).sum(-1), atol=1e-5)
