"""Vocabulary padding is masked out of the softmax: sharded and masked, the log-probs are
those of the unpadded HF vocabulary."""

from __future__ import annotations

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
