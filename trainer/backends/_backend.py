"""What every trainer backend shares: the :class:`Backend` interface the loop sees (the
step, log-probs, weights, checkpoints) and the GRPO step every backend plans and scores
the same way (:class:`StepCore`): samples packed into micro-batches by a token budget, the
old policy's log-probs from the training forward itself when it is the current one (the
ratio exactly 1, no separate pass), every token weighted by its share of the step's loss
(:func:`trainer.token_weights`: packing does not change the gradients), the gradient norm
clipped and a non-finite update skipped. :class:`MicroBatchBackend` runs it as a plain loop
(the torch backend); megatron's through megatron's own schedule.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from agentenv import ConfigError, Sample
from agentenv.engine import release_freed_memory
from trainer.algorithm import pack_by_tokens, policy_loss, token_weights
from trainer.backends._data_parallel import DataParallel
from trainer.config import LossConfig, OptimConfig

if TYPE_CHECKING:
    from trainer.backends._precision import Precision
    from trainer.backends._sender import WeightSender

__all__ = [
    "Backend",
    "Item",
    "MicroBatchBackend",
    "RanksBackend",
    "StepCore",
    "StepPlan",
    "Tally",
    "check_temperature",
    "pad",
    "response_positions",
    "to_items",
]


@dataclasses.dataclass(slots=True)
class Item:
    ids: torch.Tensor  # prompt + completion
    start: int  # index in ids of the first completion token
    mask: torch.Tensor  # loss mask over the completion, float64


def to_items(samples: Sequence[Sample]) -> list[Item]:
    out = []
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        if not s.prompt_ids or n == 0:
            raise ConfigError(f"sample {i} has no prompt or no completion: nothing to train on")
        ids = torch.tensor([*s.prompt_ids, *s.completion_ids], dtype=torch.long)
        mask = torch.tensor(list(s.loss_mask or [1] * n), dtype=torch.float64)
        out.append(Item(ids, len(s.prompt_ids), mask))
    return out


def pad(batch: Sequence[Item], *, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [b, s] of a micro-batch, right-padded with 0 (``s`` a multiple of
    ``multiple``), and the attention mask [b, s] (1 on real tokens)."""
    width = -(-max(len(it.ids) for it in batch) // multiple) * multiple
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    attention = torch.zeros(len(batch), width, dtype=torch.long)
    for row, it in enumerate(batch):
        ids[row, : len(it.ids)] = it.ids
        attention[row, : len(it.ids)] = 1
    return ids, attention


def response_positions(
    batch: Sequence[Item], *, packed: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Where each item's completion is predicted: rows [N] and columns [N] of the padded
    batch (position t predicts token t + 1) -- or, ``packed``, of the single row holding
    the items one after another -- the target ids [N], and each item's count."""
    rows, cols, targets = [], [], []
    offset = 0
    for row, it in enumerate(batch):
        n = len(it.ids) - it.start
        rows.append(torch.full((n,), 0 if packed else row, dtype=torch.long))
        cols.append(torch.arange(it.start - 1, len(it.ids) - 1) + offset)
        targets.append(it.ids[it.start :])
        offset += len(it.ids) if packed else 0
    sizes = [len(it.ids) - it.start for it in batch]
    return torch.cat(rows), torch.cat(cols), torch.cat(targets), sizes


def check_temperature(temperature: float) -> None:
    """Refuse a temperature the log-probs cannot be taken at."""
    if not math.isfinite(temperature) or temperature <= 0:
        raise ConfigError(
            f"temperature must be a finite number > 0, got {temperature!r} (greedy "
            "rollouts: logprob_temperature(sampling) gives 1)"
        )


class _Trainable(abc.ABC):
    """A model trained with the GRPO loss, one step at a time: what a backend
    (:class:`Backend`) and one process's step (:class:`StepCore`) both are -- the step's
    interface and the settings every one holds, set by :meth:`_configure` (subclasses call
    it): ``optim_config``, ``loss_config``, ``max_tokens`` (the micro-batch token budget),
    ``entropy_metric``, ``steps``; the subclass sets ``device`` and ``dtype``."""

    device: torch.device
    dtype: torch.dtype

    def _configure(
        self,
        optim: OptimConfig | None,
        loss: LossConfig | None,
        max_tokens_per_micro_batch: int,
        entropy_metric: bool,
    ) -> None:
        if max_tokens_per_micro_batch < 1:
            raise ConfigError(
                f"max_tokens_per_micro_batch must be at least 1, got {max_tokens_per_micro_batch}"
            )
        self.optim_config = optim or OptimConfig()
        self.loss_config = loss or LossConfig()
        self.max_tokens = max_tokens_per_micro_batch
        self.entropy_metric = entropy_metric
        self.steps = 0

    @abc.abstractmethod
    def logprobs(
        self, samples: Sequence[Sample], *, reference: bool = False, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """The current policy's (or, with ``reference``, the frozen reference model's)
        log-probs, float32 on CPU, of each sample's completion tokens, of ``softmax(logits
        / temperature)``: the distribution the rollouts sampled from
        (:func:`~trainer.logprob_temperature`)."""

    @abc.abstractmethod
    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: torch.Tensor | Sequence[float],
        *,
        old_logprobs: Sequence[torch.Tensor] | None = None,
        ref_logprobs: Sequence[torch.Tensor] | None = None,
        lr_step: int | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step on ``samples`` (one per advantage) with the GRPO loss: the
        samples packed into micro-batches, the loss per micro-batch, the gradient norm
        clipped, a non-finite update skipped; returns the step's metrics.

        ``old_logprobs`` default to the current policy's, taken from the step's own training
        forward, detached (the ratio is exactly 1 on fresh data; no extra pass).
        ``lr_step``: where on the learning-rate schedule this update is (default: the number
        of updates so far). The GRPO loop passes the rollout step's planned position, so
        that batches shrunk by filters or skipped do not stretch the schedule.
        ``temperature``: every log-prob and entropy is of ``softmax(logits / temperature)``,
        the distribution the rollouts sampled from (:func:`~trainer.logprob_temperature`).
        """

    @abc.abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named weights (for an engine's in-process update)."""

    @abc.abstractmethod
    def save_hf(self, directory: str | os.PathLike[str]) -> None:
        """The current weights as a complete HF model directory: config, safetensors and
        the source model's tokenizer, chat template and generation config
        (:func:`trainer._resources.copy_model_files`), loadable wherever the source was."""


class StepCore(_Trainable):
    """A model trained with the GRPO loss, one step at a time, in this process: what every
    implementation of the step shares. :meth:`logprobs` and :meth:`train_step` check and
    pack their inputs here (:meth:`_plan`) and hand them to the subclass's
    :meth:`_logprobs` and :meth:`_step`, which score each micro-batch with
    :meth:`_micro_loss` and add up its metrics in a :class:`Tally`. The torch backend
    (:class:`MicroBatchBackend`) is one; one megatron rank
    (:class:`~trainer.megatron.MegatronWorker`) is one whose shards the backend's
    checkpoint gathers.

    The subclass sets ``model``, ``reference`` (a frozen copy when ``loss.kl_coef > 0``,
    else ``None``) and ``optimizer``, besides :class:`_Trainable`'s.
    """

    model: Any
    reference: Any
    optimizer: torch.optim.Optimizer

    @torch.no_grad()
    def logprobs(
        self, samples: Sequence[Sample], *, reference: bool = False, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        check_temperature(temperature)
        if reference and self.reference is None:
            raise ConfigError("no reference model: it is loaded when loss.kl_coef > 0")
        model = self.reference if reference else self.model
        items = to_items(samples)
        groups = pack_by_tokens([len(it.ids) for it in items], self.max_tokens)
        return self._logprobs(items, groups, model, temperature)

    @abc.abstractmethod
    def _logprobs(
        self, items: list[Item], groups: list[list[int]], model: Any, temperature: float
    ) -> list[torch.Tensor]:
        """:meth:`logprobs` of ``items`` packed into the micro-batches ``groups`` (lists of
        item indices), by ``model``, without gradients: float32 on CPU, one per item."""

    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: torch.Tensor | Sequence[float],
        *,
        old_logprobs: Sequence[torch.Tensor] | None = None,
        ref_logprobs: Sequence[torch.Tensor] | None = None,
        lr_step: int | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        plan = self._plan(samples, advantages, old_logprobs, ref_logprobs, temperature)
        return self._step(plan, self.optim_config.lr_at(self.steps if lr_step is None else lr_step))

    @abc.abstractmethod
    def _step(self, plan: StepPlan, lr: float) -> dict[str, float]:
        """:meth:`train_step` of ``plan`` at the learning rate ``lr``: :meth:`_micro_loss`
        per micro-batch, the gradient norm clipped, a non-finite update skipped, ``steps``
        counted; returns the step's metrics."""

    def _plan(
        self,
        samples: Sequence[Sample],
        advantages: torch.Tensor | Sequence[float],
        old_logprobs: Sequence[torch.Tensor] | None,
        ref_logprobs: Sequence[torch.Tensor] | None,
        temperature: float = 1.0,
    ) -> StepPlan:
        """A step's inputs checked, packed into micro-batches and weighted."""
        cfg = self.loss_config
        items = to_items(samples)
        adv = torch.as_tensor(advantages, dtype=torch.float64).flatten()
        if adv.numel() != len(items):
            raise ConfigError(f"{len(items)} samples but {adv.numel()} advantages")
        if cfg.kl_coef > 0 and ref_logprobs is None:
            raise ConfigError("kl_coef > 0 needs ref_logprobs")
        check_temperature(temperature)
        weights = token_weights(
            [len(it.mask) for it in items],
            [it.mask for it in items],
            cfg,
            total_samples=len(items),
            total_tokens=int(sum(float(it.mask.sum()) for it in items)),
        )
        return StepPlan(
            samples=samples,
            items=items,
            advantages=adv,
            groups=pack_by_tokens([len(it.ids) for it in items], self.max_tokens),
            weights=weights,
            ref_logprobs=ref_logprobs,
            want_entropy=self.entropy_metric or cfg.entropy_coef > 0,
            temperature=temperature,
            old_logprobs=old_logprobs,
        )

    def _micro_loss(
        self,
        plan: StepPlan,
        group: Sequence[int],
        lps: Sequence[torch.Tensor],
        ents: Sequence[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one micro-batch (its share of the step's) and its metric sums.
        Without ``plan.old_logprobs`` the old policy is the current one: its log-probs are
        ``lps`` detached (the ratio is exactly 1)."""
        dev = lps[0].device
        old = plan.old_logprobs
        old_parts = [old[i] for i in group] if old is not None else [lp.detach() for lp in lps]

        def cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
            return torch.cat([p.to(dev, torch.float32) for p in parts])

        rollout = [plan.samples[i].rollout_logprobs for i in group]
        has_rollout = all(r is not None for r in rollout)
        ref = plan.ref_logprobs
        return policy_loss(
            cat(lps),
            cat(old_parts),
            cat([plan.advantages[i].expand(len(plan.items[i].mask)) for i in group]),
            cat([plan.weights[i] for i in group]),
            self.loss_config,
            ref_logp=cat([ref[i] for i in group]) if ref else None,
            rollout_logp=cat([torch.tensor(list(r or ())) for r in rollout])
            if has_rollout
            else None,
            entropy=cat(ents) if ents is not None else None,
        )


class Backend(_Trainable):
    """A model being trained with the GRPO loss: the interface the loop uses -- the step,
    log-probs, the weights for the engines, checkpoints, memory, closing -- which every
    backend honours whole (:class:`~trainer.TorchBackend`, the ranks on Ray
    (:class:`~trainer.distributed.TrainerGroup`), :class:`~trainer.megatron.MegatronBackend`).

    ``precision``: the numerics the torch backend trains in (its engines take them,
    :meth:`~trainer.Precision.engine_dtypes`); ``None`` for a backend of its own (megatron:
    bf16).
    """

    precision: Precision | None = None

    @property
    def has_reference(self) -> bool:
        """Whether :meth:`logprobs` takes ``reference=True``: a frozen reference model is
        loaded (``loss.kl_coef > 0``)."""
        return self.loss_config.kl_coef > 0

    def weight_sender(self) -> WeightSender:
        """The end a weight update leaves from (:mod:`trainer.backends._sender`): by default this
        process, reading :meth:`state_dict`; ranks elsewhere send from there."""
        from trainer.backends._sender import LocalSender

        return LocalSender(self.state_dict)

    @abc.abstractmethod
    def save_checkpoint(self, directory: str | os.PathLike[str], extra: dict[str, Any]) -> None:
        """Model, optimizer, RNG states and ``extra`` into ``directory``, atomically."""

    def checkpoint_snapshot(
        self, extra: dict[str, Any]
    ) -> Callable[[str | os.PathLike[str]], None] | None:
        """What :meth:`save_checkpoint` would save, copied now (to CPU memory), as a
        function that writes it into a directory, atomically, on any thread while
        training goes on (the loop writes checkpoints in the background with it).
        ``None``: this backend saves in the foreground only (:meth:`save_checkpoint`)."""
        return None

    @abc.abstractmethod
    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore :meth:`save_checkpoint`'s state; returns its ``extra``."""

    def memory_metrics(self) -> dict[str, float]:
        """Metrics of the memory of the processes this backend runs besides the loop's
        own (the ranks on Ray: ``perf/peak_rss_gib/trainer_ranks``); the loop reports
        them with each step. Empty: it runs in the loop's process."""
        return {}

    def close(self) -> None:
        """End what the backend runs besides the loop's process (its ranks); it cannot be
        used afterwards. Nothing for a backend in this process."""


class RanksBackend(Backend):
    """A backend whose model lives in ranks, each a :class:`StepCore`, that run every
    step together: the torch backend's data-parallel ranks on Ray
    (:class:`~trainer.distributed.TrainerGroup`) and megatron's
    (:class:`~trainer.megatron.MegatronBackend`). The subclass sets ``ranks`` (a
    :class:`~trainer.distributed.Ranks`); :meth:`train_step` runs on every rank, each
    counting the step as this does, and :meth:`close` ends them."""

    ranks: Any

    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: torch.Tensor | Sequence[float],
        *,
        old_logprobs: Sequence[torch.Tensor] | None = None,
        ref_logprobs: Sequence[torch.Tensor] | None = None,
        lr_step: int | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        metrics: dict[str, float] = self.ranks.call(
            StepCore.train_step, list(samples), advantages, old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs, lr_step=lr_step, temperature=temperature,
        )  # fmt: skip
        self.steps += 1
        return metrics

    def close(self) -> None:
        """End the ranks (and the process groups they set up); the backend cannot be used
        afterwards."""
        self.ranks.close()


class MicroBatchBackend(StepCore, Backend):
    """A backend whose step is a plain loop over micro-batches on one device: the
    subclass provides :meth:`_forward` (one micro-batch's log-probs) and calls
    :meth:`_make_optimizer`; this class runs :meth:`logprobs` and :meth:`train_step`
    with it, keeps fp32 master weights for a low-precision model, and saves the
    optimizer and RNG state (:meth:`_trainer_state`)."""

    #: fp32 copies of a bf16/fp16 model's trained parameters: the optimizer updates these
    #: and the model gets them rounded. Without them an update smaller than half the
    #: parameter's bf16 spacing is lost (at |w| = 0.05 anything below ~1e-4).
    master: list[torch.Tensor] | None = None
    #: This rank's place among data-parallel ranks (set once torch.distributed is up and
    #: attached to the model): a step then runs this rank's share of the micro-batches
    #: through DDP, which sums the gradients.
    data_parallel: DataParallel | None = None

    def _make_optimizer(self, *, master_weights: bool = False) -> None:
        """The optimizer; with ``master_weights`` (for a low-precision model) over fp32
        copies of the trained parameters."""
        o = self.optim_config
        params: list[torch.Tensor] = [p for p in self.model.parameters() if p.requires_grad]
        self._trained = params
        if master_weights:
            self.master = [p.detach().float().clone() for p in params]
            params = self.master
        if o.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
        else:
            # Fused: one kernel per parameter (CUDA: for all of them) updating in place.
            # The default multi-tensor path allocates temporaries the size of the model
            # (0.5 GB more peak memory for 135M parameters on CPU) and was 10x slower
            # there (781 ms against 75 ms a step, docs/benchmarks.md).
            self.optimizer = torch.optim.AdamW(
                params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                fused=True,
            )  # fmt: skip

    @abc.abstractmethod
    def _forward(
        self,
        batch: Sequence[Item],
        *,
        with_entropy: bool,
        model: Any = None,
        temperature: float = 1.0,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per item of one micro-batch: the log-probs of its completion tokens (float32,
        differentiable when grad is enabled) and, with ``with_entropy``, their entropies,
        of ``softmax(logits / temperature)``. ``model`` defaults to the trained one (the
        reference model for KL)."""

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "master": self.master,
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "steps": self.steps,
        }

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        if self.master is not None:
            saved = state.get("master")
            with torch.no_grad():
                for i, (m, p) in enumerate(zip(self.master, self._trained, strict=True)):
                    m.copy_(saved[i] if saved is not None else p)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"]:
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.steps = int(state["steps"])

    def _logprobs(
        self, items: list[Item], groups: list[list[int]], model: Any, temperature: float
    ) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(items)
        for group in groups:
            lps, _ = self._forward(
                [items[i] for i in group], with_entropy=False, model=model, temperature=temperature
            )
            for i, lp in zip(group, lps, strict=True):
                out[i] = lp.float().cpu()
        return [t for t in out if t is not None]

    def _step(self, plan: StepPlan, lr: float) -> dict[str, float]:
        t = plan.temperature
        t1 = time.perf_counter()
        tally = Tally()
        dp = self.data_parallel
        groups = plan.groups
        if dp is not None:
            groups = dp.share(groups, [len(it.ids) for it in plan.items])
        for k, group in enumerate(groups):
            batch = [plan.items[i] for i in group]
            if dp is None:
                lps, ents = self._forward(batch, with_entropy=plan.want_entropy, temperature=t)
                loss, part = self._micro_loss(plan, group, lps, ents)
                loss.backward()  # type: ignore[no-untyped-call]
            else:  # DDP averages over the ranks: the losses are the step's shares, summed
                with dp.micro_batch(last=k == len(groups) - 1):
                    lps, ents = dp.forward(batch, with_entropy=plan.want_entropy, temperature=t)
                    loss, part = self._micro_loss(plan, group, lps, ents)
                    (loss * dp.world_size).backward()  # type: ignore[no-untyped-call]
            tally.add(part)
            if self.device.type == "cpu":  # the micro-batch's activations, not kept resident
                release_freed_memory()
        if dp is not None:
            if not groups:  # fewer micro-batches than ranks: this one adds zeros
                first = [plan.items[plan.groups[0][0]]]
                dp.idle(
                    lambda: torch.cat(dp.forward(first, with_entropy=False, temperature=t)[0]).sum()
                )
            tally = Tally.of(dp.gather(tally))
        t2 = time.perf_counter()
        updated: list[torch.Tensor] = self._trained
        if self.master is not None:  # the gradients go to the fp32 copies
            for m, p in zip(self.master, self._trained, strict=True):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
            updated = self.master
        clip = self.optim_config.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(updated, clip if clip > 0 else float("inf"))
        skipped = not math.isfinite(float(norm))
        if not skipped:  # a NaN or infinite gradient would ruin the weights: skip the update
            for param_group in self.optimizer.param_groups:
                param_group["lr"] = lr
            self.optimizer.step()
            if self.master is not None:
                with torch.no_grad():
                    for m, p in zip(self.master, self._trained, strict=True):
                        p.copy_(m)  # rounded to the model's dtype
        self.optimizer.zero_grad(set_to_none=True)  # master copies: the model's went above
        self.steps += 1
        if self.device.type == "cpu":  # the step's freed memory, before the next rollout
            release_freed_memory()
        t3 = time.perf_counter()
        shared = {} if dp is None else {"micro_batches_this_rank": float(len(groups))}
        return tally.metrics(
            **shared,
            skipped_nonfinite=float(skipped),
            grad_norm=float(norm),
            lr=lr,
            micro_batches=float(len(plan.groups)),
            time_forward_backward_s=t2 - t1,
            time_optimizer_s=t3 - t2,
        )


@dataclasses.dataclass(slots=True, kw_only=True)
class StepPlan:
    """One training step's inputs: items, advantages, micro-batches (lists of item
    indices), per-token loss weights, and the old and reference log-probs per item."""

    samples: Sequence[Sample]
    items: list[Item]
    advantages: torch.Tensor
    groups: list[list[int]]
    weights: list[torch.Tensor]
    ref_logprobs: Sequence[torch.Tensor] | None
    want_entropy: bool
    #: The log-probs' and entropies' temperature (the rollouts').
    temperature: float = 1.0
    #: ``None``: the current policy's, taken from the training forward itself.
    old_logprobs: Sequence[torch.Tensor] | None = None


class Tally:
    """Adds up the micro-batches' metric sums into the step's metrics.

    Sums are weighted like the loss; divided by the total weight they are means (the loss
    itself is already the step's). ``ratio_max``/``ratio_min`` are extremes."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.ratio_max = -math.inf
        self.ratio_min = math.inf

    def add(self, part: dict[str, Any]) -> None:
        for k, v in part.items():
            if k == "ratio_max":
                self.ratio_max = max(self.ratio_max, float(v))
            elif k == "ratio_min":
                self.ratio_min = min(self.ratio_min, float(v))
            else:
                self.sums[k] = self.sums.get(k, 0.0) + float(v)

    def merge(self, other: Tally) -> None:
        self.add({**other.sums, "ratio_max": other.ratio_max, "ratio_min": other.ratio_min})

    @classmethod
    def of(cls, parts: Iterable[Tally]) -> Tally:
        """The tallies of several ranks' micro-batches as one."""
        out = cls()
        for part in parts:
            out.merge(part)
        return out

    def metrics(self, **extra: float) -> dict[str, float]:
        sums = dict(self.sums)
        weight = sums.pop("weight", 0.0) or 1.0
        metrics = {k: v if k in ("loss", "pg_loss") else v / weight for k, v in sums.items()}
        metrics.update(ratio_max=self.ratio_max, ratio_min=self.ratio_min, **extra)
        if "rollout_train_logprob_abs_diff" in metrics:
            metrics["train/rollout_train_logprob_abs_diff"] = metrics.pop(
                "rollout_train_logprob_abs_diff"
            )
        return metrics
