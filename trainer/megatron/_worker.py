"""One rank of the megatron backend: its share of the model (a pipeline stage's
tensor-parallel shard), megatron's optimizer, and what every rank runs together: the
training step, log-probs, the weights gathered to HF names, its checkpoint shards.

A step (docs/megatron.md, "The training step") deals the micro-batches to the
data-parallel replicas and runs them through megatron's forward-backward schedule; the
last stage scores each with the shared GRPO loss (:meth:`trainer.backends.StepCore._micro_loss`,
weighted for the whole step, so neither the packing nor the layout changes the
gradient), and megatron's optimizer applies the reduced gradients. A non-finite gradient
anywhere skips the update on every rank. The public methods are collective: the rank
manager (:class:`~trainer.distributed.Ranks`) runs each on all ranks at once.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from agentenv import ConfigError
from trainer.backends import (
    Item,
    StepCore,
    StepPlan,
    Tally,
    pad,
    response_positions,
)
from trainer.distributed import Rendezvous
from trainer.megatron._attention import packed_sequences
from trainer.megatron._config import MegatronModelConfig
from trainer.megatron._convert import megatron_to_hf
from trainer.megatron._export import export_hf
from trainer.megatron._logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from trainer.megatron._provider import load_weights, require_megatron
from trainer.megatron._setup import (
    MegatronOptions,
    build_model,
    init_distributed,
    make_optimizer,
    rank_place,
    set_lr,
)

__all__ = ["MegatronWorker"]


class MegatronWorker(StepCore):
    """One rank's model, reference model and optimizer on its CUDA device, and the
    collective work (:meth:`train_step`, :meth:`logprobs`, :meth:`state_dict`,
    :meth:`save_hf`, :meth:`save_shards`, :meth:`load_shards`): every rank runs each
    call together, driven by :class:`~trainer.megatron.MegatronBackend` through its
    ranks. Checkpoint directories are the backend's: a rank writes and reads only its
    shards.

    Args:
        options: the backend's checked settings (every rank the same).
        rendezvous: this rank, the world and where to meet the others.
    """

    optimizer: Any  # megatron's MegatronOptimizer (a ChainedOptimizer)

    def __init__(self, options: MegatronOptions, rendezvous: Rendezvous) -> None:
        core = require_megatron()
        if not isinstance(rendezvous.device, int):
            raise ConfigError(
                f"a megatron rank runs on a CUDA device (an index), got {rendezvous.device!r}"
            )
        self.qkv_format = options.qkv_format
        self.dp_size = options.data_parallel_size
        self.parallel = options.parallel
        self.dtype = options.dtype
        self.path = options.path
        self.device = torch.device("cuda", rendezvous.device)
        torch.cuda.set_device(self.device)
        self._owns_distributed = init_distributed(core, options, rendezvous)
        place = rank_place(core, rendezvous.rank)
        self.rank = place.rank
        self.tp_rank = place.tp_rank
        self.pp_rank = place.pp_rank
        self.dp_rank = place.dp_rank
        self.last_stage = place.last_stage
        self.cfg: MegatronModelConfig = options.parallel.model_config(options.path)
        self.model = build_model(core, options, self.cfg, place, self.device, train=True)
        self.reference: Any = None
        if options.wants_reference:
            self.reference = build_model(core, options, self.cfg, place, self.device, train=False)
        self._configure(
            options.optim,
            options.loss,
            options.max_tokens_per_micro_batch,
            options.entropy_metric,
        )
        self.optimizer = make_optimizer(core, self.model, self.optim_config, options)
        self._stepped = False  # optimizer state exists once a step was applied

    def shutdown(self) -> None:
        """This rank's part of closing: megatron's parallel state and the process group,
        where this worker created them."""
        import torch.distributed as dist

        if self._owns_distributed and dist.is_initialized():
            require_megatron().parallel_state.destroy_model_parallel()
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
        self, batch: Sequence[Item], logits: torch.Tensor, *, with_entropy: bool, temperature: float
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per item: the completion's log-probs (and entropies) from the last stage's
        vocab-parallel logits (:meth:`_run`)."""
        rows, cols, target, sizes = response_positions(batch, packed=self.qkv_format == "thd")
        picked = logits[rows.to(self.device), cols.to(self.device)]
        # ``temperature``: the rollout's sampling distribution.
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
        self,
        items: Sequence[Item],
        mine: list[tuple[list[int], bool]],
        model: Any,
        temperature: float,
    ) -> dict[int, torch.Tensor]:
        """This replica's log-probs per item index (on the last stage; empty elsewhere)."""
        out: dict[int, torch.Tensor] = {}

        def loss_of(
            group: list[int], dummy: bool, logits: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, Any]]:
            lps, _ = self._outputs(
                [items[i] for i in group], logits, with_entropy=False, temperature=temperature
            )
            if not dummy:
                out.update(zip(group, (lp.detach() for lp in lps), strict=True))
            return torch.zeros((), device=self.device), {}

        with torch.no_grad():
            self._schedule(items, mine, loss_of, model=model, forward_only=True)
        return out

    def _logprobs(
        self, items: list[Item], groups: list[list[int]], model: Any, temperature: float
    ) -> list[torch.Tensor]:
        forward = self._forward_only(items, self._mine(groups), model, temperature)
        local = {i: lp.float().cpu() for i, lp in forward.items()}
        found: dict[int, torch.Tensor] = {}
        for part in self._from_last_stages(local):
            found.update(part)
        return [found[i] for i in range(len(items))]

    # -- training -------------------------------------------------------------------------
    def _step(self, plan: StepPlan, lr: float) -> dict[str, float]:
        import torch.distributed as dist

        mine = self._mine(plan.groups)
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
        norm = math.nan
        if not skipped:
            set_lr(self.optimizer, lr, self.optim_config.weight_decay)
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
        return Tally.of(self._from_last_stages(tally)).metrics(
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
            [plan.items[i] for i in group], logits, with_entropy=plan.want_entropy,
            temperature=plan.temperature,
        )  # fmt: skip
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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named weights, merged from megatron's layout (vocabulary padding stripped);
        on rank 0 (the other ranks return an empty dict)."""
        shards = self._gather()
        return megatron_to_hf(shards, self.cfg) if shards is not None and self.rank == 0 else {}

    def save_hf(self, directory: str | os.PathLike[str]) -> None:
        shards = self._gather()
        if shards is not None and self.rank == 0:
            export_hf(directory, shards, self.cfg, dtype=self.dtype, source=self.path)

    def _shard_name(self) -> str:
        return f"tp{self.tp_rank}_pp{self.pp_rank}"

    def save_shards(self, directory: str) -> None:
        """This rank's model shard (first replica), optimizer state and RNG states into
        ``directory`` (the backend's checkpoint, being written)."""
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

    def load_shards(self, directory: str, steps: int) -> None:
        """Restore :meth:`save_shards` from ``directory``; ``steps``: the updates so far."""
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
