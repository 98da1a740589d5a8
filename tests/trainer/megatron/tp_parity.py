"""Run under ``torchrun --nproc-per-node N`` (N GPUs, N = TP): each rank builds its shard
of a tiny random model from converted HF weights; the gathered logits and the
vocab-parallel log-probs must match HF's. Used by ``test_model.py``; exits non-zero on a
mismatch."""

from __future__ import annotations

import copy
import os
import sys
import warnings

import torch
import torch.distributed as dist

from tests.trainer.megatron.tiny import tiny_model
from trainer.megatron import (
    MegatronModelConfig,
    hf_to_megatron,
    load_weights,
    model_provider,
    require_megatron,
    vocab_parallel_logprobs,
)


def main(arch: str, tied: bool) -> None:
    warnings.simplefilter("ignore")
    core = require_megatron()

    rank, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    core.parallel_state.initialize_model_parallel(tp, 1)
    core.tensor_parallel.model_parallel_cuda_manual_seed(0)
    hf_model = tiny_model(arch, tied).cuda()
    hf = {k: v.detach() for k, v in hf_model.state_dict().items()}
    cfg = MegatronModelConfig.from_hf(
        hf_model.config, tensor_model_parallel_size=tp, make_vocab_size_divisible_by=8
    )
    model = model_provider(cfg)().cuda().eval()
    load_weights(model, hf_to_megatron(hf, cfg, tp_rank=rank))
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), device="cuda")
    positions = torch.arange(12, device="cuda").expand(2, -1)
    with torch.no_grad():
        local = model(ids, positions, attention_mask=None)  # [b, s, Vp/tp]
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous())
        logits = torch.cat(parts, dim=-1)[..., : cfg.vocab_size].double()
        logp = vocab_parallel_logprobs(local[:, :-1], ids[:, 1:], vocab_size=cfg.vocab_size)
        hf32 = hf_model(ids).logits.double()
        ref = copy.deepcopy(hf_model).double()(ids).logits

    def lp(x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]

    errors = {
        "logits": float((logits - ref).abs().max()),
        "hf_logits": float((hf32 - ref).abs().max()),
        "logprobs": float((logp.double() - lp(ref)).abs().max()),
        "hf_logprobs": float((lp(hf32) - lp(ref)).abs().max()),
    }
    ok = (
        errors["logits"] <= 4 * errors["hf_logits"] + 1e-6
        and errors["logprobs"] <= 4 * errors["hf_logprobs"] + 1e-6
    )
    print(f"rank {rank} tp {tp} {arch} tied={tied} ok={ok} {errors}", flush=True)
    core.parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "tied")
