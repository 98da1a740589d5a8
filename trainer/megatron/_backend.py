"""The megatron-core training backend: an HF Llama/Qwen2 model converted into megatron's
``GPTModel`` and trained with the shared GRPO loss on megatron's own machinery.

    backend = MegatronBackend("path/to/hf", optim=OptimConfig(lr=1e-6))
    metrics = backend.train_step(samples, advantages)

    # 4 GPUs: tensor parallel 2 × data parallel 2 (megatron's flags, its names)
    backend = MegatronBackend(
        "path/to/hf", num_gpus=4,
        parallel=parse_megatron_flags(["--tensor-model-parallel-size", "2"]),
    )

A step: the samples are packed into micro-batches by the token budget and dealt to the
data-parallel replicas; megatron's forward-backward schedule (``get_forward_backward_func``:
1F1B across pipeline stages, a plain loop without) runs them through the model wrapped in
megatron's ``DistributedDataParallel``; on the last stage each micro-batch's vocab-parallel
logits give the log-probs (padding columns masked, fp32) and the shared GRPO loss
(:meth:`trainer.Backend._micro_loss`, weighted for the whole step, so neither the packing
nor the layout changes the gradient). ``finalize_model_grads`` reduces the gradients
(data-parallel replicas, tied embeddings across stages, sequence-parallel norms); megatron's
optimizer (``get_megatron_optimizer``: fp32 main weights, clipping by the global norm, the
distributed optimizer with ``--use-distributed-optimizer``) applies them. A non-finite
gradient anywhere skips the update on every rank.

With ``num_gpus > 1`` this process is rank 0 and starts the others itself
(:mod:`trainer.megatron._ranks`); the public methods are collective. The new weights leave
as HF tensors gathered on rank 0 (:meth:`state_dict`) or an HF safetensors directory
(:meth:`save_hf`). Checkpoints hold every rank's model shard and megatron's optimizer state.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from agentenv import ConfigError, Sample
from trainer._backend import (
    Backend,
    Item,
    OptimConfig,
    StepPlan,
    Tally,
    pad,
    response_positions,
    to_items,
)
from trainer._batching import pack_by_tokens
from trainer._files import free_port, replace_dir
from trainer._losses import LossConfig
from trainer.megatron._attention import packed_sequences
from trainer.megatron._config import MegatronModelConfig
from trainer.megatron._convert import hf_to_megatron, megatron_to_hf
from trainer.megatron._export import export_hf, load_hf_weights
from trainer.megatron._flags import ParallelConfig
from trainer.megatron._logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from trainer.megatron._provider import load_weights, model_provider, require_megatron
from trainer.megatron._ranks import FOLLOWER_DEVICE, Followers, collective, open_channel

__all__ = ["MegatronBackend"]


def _init_distributed(
    core: Any, parallel: ParallelConfig, seed: int, *, rank: int, world_size: int, port: int
) -> bool:
    """torch.distributed and megatron's parallel state for this layout, unless set up;
    ``True`` when this call set up torch.distributed."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            device_id=torch.device("cuda", torch.cuda.current_device()),
        )
    if not core.parallel_state.model_parallel_is_initialized():
        core.parallel_state.initialize_model_parallel(
            parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        )
    core.tensor_parallel.model_parallel_cuda_manual_seed(seed)
    open_channel()
    return owned


class MegatronBackend(Backend):
    """Trains a Llama- or Qwen2-architecture HF model on megatron-core (CUDA only).

    Args:
        model: a model name (``smollm2-135m``) or an HF directory.
        device: ``cuda`` or ``cuda:N`` (rank 0's GPU; rank r uses GPU N + r).
        dtype: parameter dtype, bfloat16 (default; fp32 main weights in the optimizer) or
            float32.
        optim: optimizer settings (megatron's optimizer: weight decay skips biases and
            norms, as megatron does).
        loss: loss settings; ``kl_coef > 0`` loads a frozen reference copy.
        max_tokens_per_micro_batch: the packing budget (prompt and completion tokens).
        parallel: megatron's parallelism flags (:func:`parse_megatron_flags`).
        num_gpus: GPUs in all; data-parallel replicas = num_gpus / (TP × PP).
        entropy_metric: report the per-token entropy.
        seed: megatron's model-parallel RNG seed.
        attention: ``sdpa`` (torch's fused kernels in megatron's layer spec) or ``local``
            (megatron's own unfused attention).
        qkv_format: ``bshd``: a micro-batch is padded rows; ``thd``: its samples are packed
            into one row without padding, attention within each sample (torch's
            variable-length flash attention; needs bf16, ``sdpa`` and no activation
            recomputation). Default: ``thd`` where it can run, else ``bshd``.
    """

    optimizer: Any  # megatron's MegatronOptimizer (a ChainedOptimizer)

    def __init__(
        self,
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
    ) -> None:
        from agentenv.engine import resolve_model

        core = require_megatron()
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise ConfigError(
                f"the megatron backend needs a CUDA device (megatron-core does not run on "
                f"CPU), got device {device!r}; use the torch backend there"
            )
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
        self.qkv_format = qkv_format
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
        self.dp_size = parallel.data_parallel_size(num_gpus)
        self.parallel = parallel
        self.attention = attention
        self.dtype = dtype
        self.path = resolve_model(model)
        self.followers: Followers | None = None
        follower_device = os.environ.get(FOLLOWER_DEVICE)
        if follower_device is not None:  # a rank > 0, started by rank 0
            self.device = torch.device("cuda", int(follower_device))
            rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
        else:
            self.device = torch.device(device)
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            rank, port = 0, free_port()
            if self.device.index + num_gpus > torch.cuda.device_count():
                raise ConfigError(
                    f"num_gpus {num_gpus} from {self.device} needs GPUs "
                    f"{self.device.index}..{self.device.index + num_gpus - 1}, but "
                    f"{torch.cuda.device_count()} are visible"
                )
            if num_gpus > 1:
                kwargs = dict(
                    model=str(self.path), dtype=dtype, optim=optim, loss=loss,
                    max_tokens_per_micro_batch=max_tokens_per_micro_batch, parallel=parallel,
                    num_gpus=num_gpus, entropy_metric=entropy_metric, seed=seed,
                    attention=attention, qkv_format=qkv_format,
                )  # fmt: skip
                devices = list(range(self.device.index, self.device.index + num_gpus))
                self.followers = Followers(
                    num_gpus, "trainer.megatron._backend:MegatronBackend", kwargs, devices, port
                )
                atexit.register(self.close)
        torch.cuda.set_device(self.device)
        self._owns_distributed = _init_distributed(
            core, parallel, seed, rank=rank, world_size=num_gpus, port=port
        )
        ps = core.parallel_state
        self.rank = rank
        self.tp_rank = int(ps.get_tensor_model_parallel_rank())
        self.pp_rank = int(ps.get_pipeline_model_parallel_rank())
        self.dp_rank = int(ps.get_data_parallel_rank())
        self.first_stage = bool(ps.is_pipeline_first_stage())
        self.last_stage = bool(ps.is_pipeline_last_stage())
        self.cfg: MegatronModelConfig = parallel.model_config(self.path)
        self.model = self._build(train=True)
        self.reference: Any = None
        if loss is not None and loss.kl_coef > 0:
            self.reference = self._build(train=False)
        self._configure(optim, loss, max_tokens_per_micro_batch, entropy_metric)
        self._make_optimizer()

    # -- set-up ---------------------------------------------------------------------------
    def _build(self, *, train: bool) -> Any:
        core = require_megatron()
        overrides = dict(
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            **self.parallel.transformer_config_overrides(),
        )
        if self.parallel.pipeline_model_parallel_size > 1:
            # Micro-batches differ in shape: the stages send each other the shapes first.
            # (megatron refuses that beside its default MoE dispatcher, even without MoE.)
            overrides.update(
                variable_seq_lengths=True,
                moe_token_dispatcher_type="alltoall",
                pipeline_dtype=self.dtype,  # what the stages send each other
            )
        with warnings.catch_warnings():  # megatron's notices about optional packages
            warnings.simplefilter("ignore")
            provide = model_provider(self.cfg, attention=self.attention, **overrides)
            model = provide(pre_process=self.first_stage, post_process=self.last_stage)
        model = model.to(self.device)
        if self.dtype == torch.bfloat16:
            # As megatron's Float16Module does: the local spec builds its norms in fp32,
            # and an fp32 norm weight on bf16 activations misses torch's fused RMSNorm.
            model = model.bfloat16()
        hf = load_hf_weights(self.path)
        shard = hf_to_megatron(hf, self.cfg, tp_rank=self.tp_rank, pp_rank=self.pp_rank)
        load_weights(model, shard)
        if not train:
            return model.eval().requires_grad_(False)
        p = self.parallel
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

    def _make_optimizer(self) -> None:
        """megatron's optimizer: it keeps fp32 main weights itself in bf16."""
        core = require_megatron()
        o = self.optim_config
        config = core.optimizer.OptimizerConfig(
            optimizer="sgd" if o.optimizer == "sgd" else "adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            sgd_momentum=0.0,
            # 0 turns clipping off; a huge bound keeps megatron computing the norm.
            clip_grad=o.grad_clip if o.grad_clip > 0 else 1e30,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=self.parallel.use_distributed_optimizer,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.optimizer = core.optimizer.get_megatron_optimizer(config, [self.model])
        # Without Transformer Engine or apex megatron falls back to torch's AdamW in its
        # multi-tensor form; on the fp32 main weights the fused kernel is one pass.
        for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(part, "optimizer", None)
            if isinstance(inner, torch.optim.AdamW):
                for group in inner.param_groups:
                    group.update(fused=True, foreach=False)
        self._set_lr(o.lr)
        self._stepped = False  # optimizer state exists once a step was applied

    def _set_lr(self, lr: float) -> None:
        """The learning rate, and the weight decay where megatron allows it (its parameter
        groups mark biases and norms with ``wd_mult`` 0; its own scheduler applies that)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = self.optim_config.weight_decay * group.get("wd_mult", 1.0)

    def close(self) -> None:
        """Stop the other ranks (rank 0) and take down the process groups this backend set
        up; the backend cannot be used afterwards."""
        if self.followers is not None:
            self.followers.close()
            self.followers = None
        self.shutdown()

    def shutdown(self) -> None:
        """This rank's part of :meth:`close`: megatron's parallel state and the process
        group, where this backend created them."""
        import torch.distributed as dist

        from trainer.megatron import _ranks

        if self._owns_distributed and dist.is_initialized():
            require_megatron().parallel_state.destroy_model_parallel()
            _ranks._channel = None
            dist.destroy_process_group()
            self._owns_distributed = False

    # -- the forward pass -----------------------------------------------------------------
    def _run(self, model: Any, batch: Sequence[Item]) -> torch.Tensor:
        """The model on one micro-batch: the last stage's vocab-parallel logits
        [rows, s, Vp / tp] (other stages: their hidden states). ``bshd``: one right-padded
        row per item (causal attention ignores the padding); ``thd``: the items packed into
        one row without padding, attention kept within each (:func:`packed_sequences`)."""
        p = self.parallel
        multiple = p.tensor_model_parallel_size if p.sequence_parallel else 1
        if self.qkv_format == "bshd":
            ids, _ = pad(batch, multiple=multiple)
            ids = ids.to(self.device)
            positions = torch.arange(ids.shape[1], device=self.device).expand(len(batch), -1)
            return model(ids, positions, None)  # type: ignore[no-any-return]
        lengths = [len(it.ids) for it in batch]
        total = sum(lengths)
        filler = -total % multiple  # sequence parallelism splits the row into TP parts
        if filler:
            lengths.append(filler)  # a segment of its own: it attends to nothing real
        ids = torch.zeros(1, total + filler, dtype=torch.long)
        ids[0, :total] = torch.cat([it.ids for it in batch])
        ids = ids.to(self.device)
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        with packed_sequences(bounds.to(self.device), max(lengths)):
            return model(ids, positions, None)  # type: ignore[no-any-return]

    def _outputs(
        self, batch: Sequence[Item], logits: torch.Tensor, *, with_entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per item: the completion's log-probs (and entropies) from the last stage's
        vocab-parallel logits (:meth:`_run`)."""
        rows, cols, target, sizes = response_positions(batch, packed=self.qkv_format == "thd")
        picked = logits[rows.to(self.device), cols.to(self.device)]
        temperature = self.loss_config.temperature  # the rollout's sampling distribution
        logp = vocab_parallel_logprobs(
            picked, target.to(self.device), vocab_size=self.cfg.vocab_size,
            temperature=temperature, tp_rank=self.tp_rank,
        )  # fmt: skip
        entropy = None
        if with_entropy:
            grad = self.loss_config.entropy_coef > 0 and torch.is_grad_enabled()
            with torch.set_grad_enabled(grad):
                ent = vocab_parallel_entropy(
                    picked, vocab_size=self.cfg.vocab_size, temperature=temperature,
                    tp_rank=self.tp_rank,
                )  # fmt: skip
            entropy = list(torch.split(ent, sizes))
        return list(torch.split(logp, sizes)), entropy

    def _mine(self, groups: list[list[int]]) -> list[tuple[list[int], bool]]:
        """This data-parallel replica's micro-batches, dealt round-robin; a replica left
        without one runs the first with zero weight (``True``: it must join the gradient
        reduction)."""
        mine = [(g, False) for g in groups[self.dp_rank :: self.dp_size]]
        return mine or [(groups[0], True)]

    def _schedule(
        self,
        items: Sequence[Item],
        mine: list[tuple[list[int], bool]],
        loss_of: Callable[[list[int], bool, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]],
        *,
        model: Any,
        forward_only: bool,
    ) -> None:
        """Run this replica's micro-batches through megatron's forward-backward schedule;
        ``loss_of(group, dummy, logits)`` runs on the last stage for each."""
        core = require_megatron()
        data = iter(mine)

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            group, dummy = next(data_iterator)
            output = self._run(model, [items[i] for i in group])
            return output, functools.partial(loss_of, group, dummy)

        widths = [max(len(items[i].ids) for i in g) for g, _ in mine]
        run = core.pipeline_parallel.get_forward_backward_func()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            run(
                forward_step_func=forward_step,
                data_iterator=data,
                model=[model],
                num_microbatches=len(mine),
                seq_length=max(widths),
                micro_batch_size=max(len(g) for g, _ in mine),
                forward_only=forward_only,
            )

    def _from_last_stages(self, part: Any) -> list[Any]:
        """Every replica's ``part`` from its last pipeline stage (one tensor-parallel rank
        each: the others hold the same), on every rank."""
        import torch.distributed as dist

        if dist.get_world_size() == 1:
            return [part]
        keep = self.last_stage and self.tp_rank == 0
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, part if keep else None)
        return [p for p in parts if p is not None]

    def _forward_only(
        self, items: Sequence[Item], mine: list[tuple[list[int], bool]], model: Any
    ) -> dict[int, torch.Tensor]:
        """This replica's log-probs per item index (on the last stage; empty elsewhere)."""
        out: dict[int, torch.Tensor] = {}

        def loss_of(
            group: list[int], dummy: bool, logits: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, Any]]:
            lps, _ = self._outputs([items[i] for i in group], logits, with_entropy=False)
            if not dummy:
                out.update(zip(group, (lp.detach() for lp in lps), strict=True))
            return torch.zeros((), device=self.device), {}

        with torch.no_grad():
            self._schedule(items, mine, loss_of, model=model, forward_only=True)
        return out

    @collective
    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample], *, reference: bool = False) -> list[torch.Tensor]:
        model = self._model_for(reference)
        items = to_items(samples)
        mine = self._mine(pack_by_tokens([len(it.ids) for it in items], self.max_tokens))
        local = {i: lp.float().cpu() for i, lp in self._forward_only(items, mine, model).items()}
        found: dict[int, torch.Tensor] = {}
        for part in self._from_last_stages(local):
            found.update(part)
        return [found[i] for i in range(len(items))]

    # -- training -------------------------------------------------------------------------
    @collective
    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: torch.Tensor | Sequence[float],
        *,
        old_logprobs: Sequence[torch.Tensor] | None = None,
        ref_logprobs: Sequence[torch.Tensor] | None = None,
        lr_step: int | None = None,
    ) -> dict[str, float]:
        import torch.distributed as dist

        plan = self._plan(samples, advantages, ref_logprobs)
        mine = self._mine(plan.groups)
        # Without old log-probs the old policy is the current one: the loss on the last
        # stage takes them from the training forward, detached (ratio exactly 1).
        plan.old_logprobs = old_logprobs
        t1 = time.perf_counter()
        tally = Tally()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._schedule(
            plan.items,
            mine,
            functools.partial(self._loss_of, plan, tally, len(mine)),
            model=self.model,
            forward_only=False,
        )
        t2 = time.perf_counter()
        # A non-finite gradient on any rank skips the update on all of them (megatron's
        # own check: one fused pass, no temporaries).
        bad = torch.zeros(1, device=self.device)
        one = torch.ones(1, device=self.device)
        grads = [b.grad_data for b in self.model.buffers]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, bad, one)
        if dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        skipped = bool(bad.item())
        lr = self.optim_config.lr_at(self.steps if lr_step is None else lr_step)
        norm = math.nan
        if not skipped:
            self._set_lr(lr)
            ok, grad_norm, _ = self.optimizer.step()
            skipped = not ok
            self._stepped = self._stepped or ok
            norm = float(grad_norm) if grad_norm is not None else math.nan
            if self.parallel.overlap_param_gather:
                # The new shards would otherwise reach the other replicas only at the next
                # forward: the weights exported or saved before it would be stale.
                self.model.start_param_sync(force_sync=True)
        self.steps += 1
        t3 = time.perf_counter()
        total = Tally()
        for part in self._from_last_stages(tally):
            total.merge(part)
        return total.metrics(
            skipped_nonfinite=float(skipped),
            grad_norm=norm,
            lr=lr,
            micro_batches=float(len(plan.groups)),
            time_forward_backward_s=t2 - t1,
            time_optimizer_s=t3 - t2,
        )

    def _loss_of(
        self,
        plan: StepPlan,
        tally: Tally,
        count: int,
        group: list[int],
        dummy: bool,
        logits: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """One micro-batch's loss on the last stage. megatron's schedule divides it by the
        replica's micro-batch count and its gradient reduction averages the replicas;
        both are undone, since the step's token weights already make the sum the loss."""
        if dummy:  # zero, but part of the graph: the backward and the reduction still run
            return logits.float().sum() * 0.0, {}
        lps, ents = self._outputs(
            [plan.items[i] for i in group], logits, with_entropy=plan.want_entropy
        )
        loss, part = self._micro_loss(plan, group, lps, ents)
        tally.add(part)
        return loss * (count * self.dp_size), {}

    # -- weights out ------------------------------------------------------------------------
    def _megatron_state(self) -> dict[str, torch.Tensor]:
        return {
            k: v.detach()
            for k, v in self.model.module.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
        }

    def _gather(self) -> list[list[dict[str, torch.Tensor]]] | None:
        """Every stage's and tensor-parallel rank's state, ``[pp][tp]``, on the first
        replica's ranks (``None`` on the others)."""
        import torch.distributed as dist

        core = require_megatron()
        ps = core.parallel_state
        local = self._megatron_state()
        tp, pp = self.cfg.tensor_model_parallel_size, self.cfg.pipeline_model_parallel_size
        if tp * pp == 1:
            return [[local]] if self.dp_rank == 0 else None
        if self.dp_rank != 0:
            return None
        mine: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for name, tensor in local.items():  # the same names in the same order on each TP rank
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(parts, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
            for r in range(tp):
                mine[r][name] = parts[r]
        group = ps.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        stages: list[list[dict[str, torch.Tensor]]] = []
        for stage, src in enumerate(ranks):
            box: list[Any] = [
                [[(k, tuple(v.shape), v.dtype) for k, v in st.items()] for st in mine]
                if stage == self.pp_rank
                else None
            ]
            dist.broadcast_object_list(box, src=src, group=group)
            shards = []
            for r, entries in enumerate(box[0]):
                shard = {}
                for name, shape, dtype in entries:
                    t = (
                        mine[r][name]
                        if stage == self.pp_rank
                        else torch.empty(shape, dtype=dtype, device=self.device)
                    )
                    dist.broadcast(t, src=src, group=group)
                    shard[name] = t
                shards.append(shard)
            stages.append(shards)
        return stages

    @collective
    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named weights, merged from megatron's layout (vocabulary padding stripped);
        on rank 0 (the other ranks return an empty dict)."""
        shards = self._gather()
        return megatron_to_hf(shards, self.cfg) if shards is not None and self.rank == 0 else {}

    @collective
    def save_hf(self, directory: str | os.PathLike[str]) -> None:
        shards = self._gather()
        if shards is not None and self.rank == 0:
            export_hf(directory, shards, self.cfg, dtype=self.dtype, source=self.path)

    # -- checkpoints ----------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {
            "backend": "megatron",
            "architecture": self.cfg.architecture,
            "vocab_size": self.cfg.vocab_size,
            "hidden_size": self.cfg.hidden_size,
            "num_layers": self.cfg.num_layers,
            "tensor_model_parallel_size": self.cfg.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.cfg.pipeline_model_parallel_size,
            "data_parallel_size": self.dp_size,
            "use_distributed_optimizer": self.parallel.use_distributed_optimizer,
        }

    def _shard_name(self) -> str:
        return f"tp{self.tp_rank}_pp{self.pp_rank}"

    def save_checkpoint(self, directory: str | os.PathLike[str], extra: dict[str, Any]) -> None:
        """Every rank's model shard and optimizer state, rank 0's RNG and ``extra``."""
        with replace_dir(directory) as tmp:
            self._save_shards(str(tmp.resolve()))
            torch.save(
                {"torch_rng": torch.get_rng_state(), "steps": self.steps},
                tmp / "trainer_state.pt",
            )
            (tmp / "checkpoint.json").write_text(
                json.dumps({"model": self._identity(), "extra": extra}, indent=1)
            )

    @collective
    def _save_shards(self, directory: str) -> None:
        import torch.distributed as dist

        root = Path(directory)
        name = self._shard_name()
        if self.dp_rank == 0:
            torch.save(self._megatron_state(), root / f"model_{name}.pt")
        # Before the first applied step the optimizer has no state to save (and megatron's
        # distributed optimizer cannot save an empty one).
        if self._stepped and self.dp_rank == 0:
            torch.save(self.optimizer.state_dict(), root / f"optimizer_{name}.pt")
        if self._stepped and self.parallel.use_distributed_optimizer:  # replicas hold parts
            self.optimizer.save_parameter_state(str(root / f"optimizer_params_{name}.pt"))
        torch.save(
            {
                "cuda_rng": torch.cuda.get_rng_state(),
                "tracker": require_megatron().tensor_parallel.get_cuda_rng_tracker().get_states(),
            },
            root / f"rng_rank{self.rank}.pt",
        )
        if dist.get_world_size() > 1:
            dist.barrier()

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        root = Path(directory)
        try:
            meta = json.loads((root / "checkpoint.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{str(root)!r} is not a trainer checkpoint: {e}") from None
        if meta.get("model") != self._identity():
            raise ConfigError(
                f"checkpoint {str(root)!r} is from another model or layout "
                f"(checkpoint: {meta.get('model')}, this: {self._identity()})"
            )
        state = torch.load(root / "trainer_state.pt", weights_only=False)
        torch.set_rng_state(state["torch_rng"])
        self._load_shards(str(root.resolve()), int(state["steps"]))
        extra: dict[str, Any] = meta.get("extra", {})
        return extra

    @collective
    def _load_shards(self, directory: str, steps: int) -> None:
        root = Path(directory)
        name = self._shard_name()
        load_weights(
            self.model.module, torch.load(root / f"model_{name}.pt", map_location=self.device)
        )
        self.optimizer.reload_model_params()
        saved = root / f"optimizer_{name}.pt"
        self._stepped = saved.exists()  # saved before the first step: nothing to restore
        if self._stepped:
            self.optimizer.load_state_dict(
                torch.load(saved, map_location=self.device, weights_only=False)
            )
        if self._stepped and self.parallel.use_distributed_optimizer:
            self.optimizer.load_parameter_state(str(root / f"optimizer_params_{name}.pt"))
        rng = torch.load(root / f"rng_rank{self.rank}.pt", weights_only=False)
        torch.cuda.set_rng_state(rng["cuda_rng"])
        require_megatron().tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        self.steps = steps
