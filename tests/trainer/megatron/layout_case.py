"""One parallel layout of the megatron backend on a small random model, fp32: log-probs,
a training step, the gathered weights, and a checkpoint resume, saved for comparison
across layouts by ``test_layouts_gpu.py``.

    python -m tests.trainer.megatron.layout_case MODEL_DIR OUT --gpus 2 --tp 2
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import warnings

import torch

from agentenv import Sample
from trainer import OptimConfig, compute_advantages


def samples(n: int = 12, vocab: int = 32000, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        lp, lc = (int(torch.randint(a, b, (1,), generator=g)) for a, b in ((8, 40), (4, 30)))
        out.append(
            Sample(
                prompt_ids=torch.randint(3, vocab, (lp,), generator=g).tolist(),
                completion_ids=torch.randint(3, vocab, (lc,), generator=g).tolist(),
                reward=float(i % 3),
                group_id=f"g{i // 4}",
            )
        )
    return out


def main() -> None:
    from trainer.megatron import MegatronBackend, ParallelConfig

    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--distributed-optimizer", action="store_true")
    a = p.parse_args()
    warnings.simplefilter("ignore")
    backend = MegatronBackend(
        a.model,
        dtype=torch.float32,
        num_gpus=a.gpus,
        optim=OptimConfig(lr=1e-4, grad_clip=1.0),
        max_tokens_per_micro_batch=160,  # several micro-batches per step
        parallel=ParallelConfig(
            tensor_model_parallel_size=a.tp,
            pipeline_model_parallel_size=a.pp,
            sequence_parallel=a.sequence_parallel,
            use_distributed_optimizer=a.distributed_optimizer,
        ),
    )
    data = samples()
    adv = compute_advantages([s.reward for s in data], [s.group_id for s in data])
    result: dict[str, object] = {"before": backend.logprobs(data)}
    result["step1"] = backend.train_step(data, adv)
    result["after"] = backend.logprobs(data)
    result["weights"] = {k: v.float().cpu() for k, v in backend.state_dict().items()}
    ckpt = tempfile.mkdtemp()
    backend.save_checkpoint(f"{ckpt}/c", {"note": "x"})
    # Old log-probs from before the first step: the ratio is no longer 1, so the loss
    # depends on the model and the layout.
    result["step2"] = backend.train_step(data, adv, old_logprobs=result["before"])
    result["after2"] = backend.logprobs(data)
    assert backend.load_checkpoint(f"{ckpt}/c") == {"note": "x"}
    result["step2_resumed"] = backend.train_step(data, adv, old_logprobs=result["before"])
    result["after2_resumed"] = backend.logprobs(data)
    # One sample: a single micro-batch, so a second data-parallel replica has none.
    result["single"] = backend.train_step(data[:1], [1.0])
    shutil.rmtree(ckpt)
    backend.close()
    torch.save(result, a.out)


if __name__ == "__main__":
    main()
