"""Setting up one rank of the megatron backend: the checked options every rank builds
from, torch.distributed and megatron's parallel state, the model (HF weights converted
into this rank's shard, wrapped in megatron's ``DistributedDataParallel``) and megatron's
optimizer.

    options = resolve_options("path/to/hf", parallel=ParallelConfig(), num_gpus=2)
    owned = init_distributed(core, options, Rendezvous(rank, 2, device, port))
    place = rank_place(core, rank)
    model = build_model(options, cfg, place, device, train=True)
    optimizer = make_optimizer(model, options.optim or OptimConfig(), options)

Nothing here starts a process or knows about the other ranks beyond the rendezvous
(:func:`~trainer.megatron.launch_ranks` places them); the step is :mod:`trainer.megatron._worker`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from agentenv import ConfigError
from trainer.config import LossConfig, OptimConfig
from trainer.distributed import Rendezvous
from trainer.megatron._config import MegatronModelConfig
from trainer.megatron._convert import hf_to_megatron
from trainer.megatron._export import load_hf_weights
from trainer.megatron._flags import ParallelConfig
from trainer.megatron._provider import load_weights, model_provider

__all__ = [
    "MegatronOptions",
    "RankPlace",
    "build_model",
    "init_distributed",
    "make_optimizer",
    "rank_place",
    "resolve_options",
    "set_lr",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MegatronOptions:
    """A megatron backend's settings, checked (:func:`resolve_options`): what every rank
    builds its share of the model from (pickled for the other ranks). The fields are
    :class:`~trainer.megatron.MegatronBackend`'s arguments; ``path`` is the resolved HF
    directory and ``qkv_format`` is never ``None``."""

    path: Path
    device: str
    dtype: torch.dtype
    optim: OptimConfig | None
    loss: LossConfig | None
    max_tokens_per_micro_batch: int
    parallel: ParallelConfig
    num_gpus: int
    entropy_metric: bool
    seed: int
    attention: str
    qkv_format: str

    @property
    def data_parallel_size(self) -> int:
        """Model replicas: ``num_gpus / (TP × PP)``."""
        return self.parallel.data_parallel_size(self.num_gpus)

    @property
    def wants_reference(self) -> bool:
        """A frozen reference copy is loaded (``loss.kl_coef > 0``)."""
        return self.loss is not None and self.loss.kl_coef > 0


def resolve_options(
    model: str | os.PathLike[str] = "smollm2-135m",
    *,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    optim: OptimConfig | None = None,
    loss: LossConfig | None = None,
    max_tokens_per_micro_batch: int = 4096,
    parallel: ParallelConfig | None = None,
    num_gpus: int = 1,
    entropy_metric: bool = True,
    seed: int = 0,
    attention: str = "sdpa",
    qkv_format: str | None = None,
) -> MegatronOptions:
    """The backend's arguments checked and completed (the default ``qkv_format``, the
    model's directory); every error is a :class:`~agentenv.ConfigError` raised before any
    rank starts. Needs neither megatron nor a GPU."""
    from agentenv.engine import resolve_model

    if dtype not in (torch.bfloat16, torch.float32):
        raise ConfigError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    if attention not in ("sdpa", "local"):
        raise ConfigError(f"attention must be 'sdpa' or 'local', got {attention!r}")
    if qkv_format is None:
        packable = dtype == torch.bfloat16 and attention == "sdpa"
        no_recompute = parallel is None or parallel.recompute_granularity is None
        qkv_format = "thd" if packable and no_recompute else "bshd"
    if qkv_format not in ("bshd", "thd"):
        raise ConfigError(f"qkv_format must be 'bshd' or 'thd', got {qkv_format!r}")
    if qkv_format == "thd" and dtype != torch.bfloat16:
        raise ConfigError(
            "qkv_format 'thd' (packed sequences) runs flash attention, which needs "
            "bfloat16; use 'bshd' for float32"
        )
    if qkv_format == "thd" and parallel and parallel.recompute_granularity is not None:
        raise ConfigError(
            "qkv_format 'thd' (packed sequences) cannot be combined with "
            "--recompute-granularity: the recomputed attention would not know the "
            "sequence bounds"
        )
    if qkv_format == "thd" and attention != "sdpa":
        raise ConfigError(
            "qkv_format 'thd' (packed sequences) needs attention 'sdpa': megatron's local "
            "attention has no packed-sequence path"
        )
    if max_tokens_per_micro_batch < 1:  # (the backend's own check, before any rank starts)
        raise ConfigError(
            f"max_tokens_per_micro_batch must be at least 1, got {max_tokens_per_micro_batch}"
        )
    parallel = parallel or ParallelConfig()
    if parallel.use_distributed_optimizer and optim is not None and optim.optimizer == "sgd":
        raise ConfigError(
            "--use-distributed-optimizer works with adam only (megatron's distributed "
            "optimizer has no SGD)"
        )
    if parallel.context_parallel_size > 1:
        raise ConfigError(
            "--context-parallel-size > 1 needs Transformer Engine's attention, which "
            "this backend does not use"
        )
    parallel.data_parallel_size(num_gpus)  # the layout divides the GPUs
    return MegatronOptions(
        path=resolve_model(model),
        device=device,
        dtype=dtype,
        optim=optim,
        loss=loss,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        parallel=parallel,
        num_gpus=num_gpus,
        entropy_metric=entropy_metric,
        seed=seed,
        attention=attention,
        qkv_format=qkv_format,
    )


def init_distributed(core: Any, options: MegatronOptions, rendezvous: Rendezvous) -> bool:
    """torch.distributed (NCCL, on the current CUDA device) and megatron's parallel state
    for the layout, unless set up; ``True`` when this call set up torch.distributed."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(
            "nccl",
            init_method=rendezvous.init_method,
            rank=rendezvous.rank,
            world_size=rendezvous.world_size,
            device_id=torch.device("cuda", torch.cuda.current_device()),
        )
    parallel = options.parallel
    if not core.parallel_state.model_parallel_is_initialized():
        core.parallel_state.initialize_model_parallel(
            parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        )
    core.tensor_parallel.model_parallel_cuda_manual_seed(options.seed)
    return owned


@dataclasses.dataclass(frozen=True, slots=True)
class RankPlace:
    """Where a rank sits in the layout (megatron's parallel state)."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    first_stage: bool
    last_stage: bool


def rank_place(core: Any, rank: int) -> RankPlace:
    """This rank's place, read from megatron's parallel state (after :func:`init_distributed`)."""
    ps = core.parallel_state
    return RankPlace(
        rank=rank,
        tp_rank=int(ps.get_tensor_model_parallel_rank()),
        pp_rank=int(ps.get_pipeline_model_parallel_rank()),
        dp_rank=int(ps.get_data_parallel_rank()),
        first_stage=bool(ps.is_pipeline_first_stage()),
        last_stage=bool(ps.is_pipeline_last_stage()),
    )


def build_model(
    core: Any,
    options: MegatronOptions,
    cfg: MegatronModelConfig,
    place: RankPlace,
    device: torch.device,
    *,
    train: bool,
) -> Any:
    """This rank's stage and tensor-parallel shard of the model with the HF weights; with
    ``train`` wrapped in megatron's ``DistributedDataParallel`` (fp32 gradient buffers),
    else frozen (the reference model)."""
    dtype, p = options.dtype, options.parallel
    overrides = dict(
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        **p.transformer_config_overrides(),
    )
    if p.pipeline_model_parallel_size > 1:
        # Micro-batches differ in shape: the stages send each other the shapes first.
        # (megatron refuses that beside its default MoE dispatcher, even without MoE.)
        overrides.update(
            variable_seq_lengths=True,
            moe_token_dispatcher_type="alltoall",
            pipeline_dtype=dtype,  # what the stages send each other
        )
    with warnings.catch_warnings():  # megatron's notices about optional packages
        warnings.simplefilter("ignore")
        provide = model_provider(cfg, attention=options.attention, **overrides)
        model = provide(pre_process=place.first_stage, post_process=place.last_stage)
    model = model.to(device)
    if dtype == torch.bfloat16:
        # As megatron's Float16Module does: the local spec builds its norms in fp32,
        # and an fp32 norm weight on bf16 activations misses torch's fused RMSNorm.
        model = model.bfloat16()
    hf = load_hf_weights(options.path)
    shard = hf_to_megatron(hf, cfg, tp_rank=place.tp_rank, pp_rank=place.pp_rank)
    load_weights(model, shard)
    if not train:
        return model.eval().requires_grad_(False)
    ddp_config = core.distributed.DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
    )
    ddp = core.distributed.DistributedDataParallel(
        config=model.config, ddp_config=ddp_config, module=model
    )
    ddp.config.no_sync_func = ddp.no_sync
    ddp.config.finalize_model_grads_func = core.distributed.finalize_model_grads
    if p.overlap_grad_reduce:
        ddp.config.grad_sync_func = ddp.start_grad_sync
    return ddp.train()


def make_optimizer(core: Any, model: Any, optim: OptimConfig, options: MegatronOptions) -> Any:
    """megatron's optimizer for ``model`` (it keeps fp32 main weights itself in bf16), at
    ``optim.lr`` (:func:`set_lr`)."""
    config = core.optimizer.OptimizerConfig(
        optimizer="sgd" if optim.optimizer == "sgd" else "adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        sgd_momentum=0.0,
        # 0 turns clipping off; a huge bound keeps megatron computing the norm.
        clip_grad=optim.grad_clip if optim.grad_clip > 0 else 1e30,
        bf16=options.dtype == torch.bfloat16,
        params_dtype=options.dtype,
        use_distributed_optimizer=options.parallel.use_distributed_optimizer,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = core.optimizer.get_megatron_optimizer(config, [model])
    # Without Transformer Engine or apex megatron falls back to torch's AdamW in its
    # multi-tensor form; on the fp32 main weights the fused kernel is one pass.
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.AdamW):
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)
    set_lr(optimizer, optim.lr, optim.weight_decay)
    return optimizer


def set_lr(optimizer: Any, lr: float, weight_decay: float) -> None:
    """The learning rate, and the weight decay where megatron allows it (its parameter
    groups mark biases and norms with ``wd_mult`` 0; its own scheduler applies that)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
