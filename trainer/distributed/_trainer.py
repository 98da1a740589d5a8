"""The torch backend across Ray actors: data-parallel ranks, each a whole
:class:`~trainer.TorchBackend` in its actor, and :class:`TrainerGroup`, the backend the
loop talks to, which fans each call out to them. Every rank runs its share of a step's
micro-batches and DDP sums the gradients (:class:`~trainer.backends.DataParallel`), so a
step on N ranks is the step on one up to the order of fp32 additions; why DDP and whole
copies rather than FSDP2 or sharding: docs/benchmarks.md (``agentenv bench data-parallel``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from agentenv import Sample
from trainer._resources import peak_rss_gib
from trainer.backends import DataParallel, RanksBackend, TorchBackend, resolve_precision
from trainer.config import LossConfig, OptimConfig
from trainer.distributed._ranks import RankGroup, RankSender, Rendezvous

if TYPE_CHECKING:
    from trainer.distributed._placement import Placed

__all__ = ["TorchRank", "TorchSpec", "TrainerGroup"]


@dataclasses.dataclass(frozen=True, slots=True)
class TorchSpec:
    """What every rank builds: :class:`~trainer.TorchBackend`'s keyword arguments (less
    ``device``, which is the rank's)."""

    model: str
    kwargs: dict[str, Any]


class TorchRank(TorchBackend):
    """One data-parallel rank: joins the others (gloo on CPU, NCCL on its GPU), then
    builds the torch backend on its device."""

    def __init__(self, spec: TorchSpec, rendezvous: Rendezvous) -> None:
        import torch.distributed as dist

        device = "cpu" if rendezvous.device == "cpu" else f"cuda:{rendezvous.device}"
        dist.init_process_group(
            rendezvous.backend,
            init_method=rendezvous.init_method,
            rank=rendezvous.rank,
            world_size=rendezvous.world_size,
        )
        super().__init__(spec.model, device=device, **spec.kwargs)
        if rendezvous.world_size > 1:  # one rank: the plain step
            dp = DataParallel(rendezvous.rank, rendezvous.world_size)
            dp.attach(self.model, self._forward)
            self.data_parallel = dp

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup(RanksBackend):
    """The trainer ranks behind the :class:`~trainer.Backend` interface: ``train_step``
    and ``load_checkpoint`` run on every rank; ``logprobs`` splits the samples over the
    ranks; ``state_dict``, ``save_hf`` and ``save_checkpoint`` are rank 0's (every rank
    holds the same weights and optimizer state). Checkpoints go to a path every node
    reaches (a shared filesystem), as the weights do with ``--weight-sync disk``.

    Build one with :meth:`start`; the model lives in the actors.
    """

    ranks: RankGroup[Any]

    def __init__(
        self,
        ranks: RankGroup[Any],
        *,
        precision: str | None = None,
        gpus: bool = False,
        optim: OptimConfig | None = None,
        loss: LossConfig | None = None,
        max_tokens_per_micro_batch: int = 4096,
        entropy_metric: bool = True,
    ) -> None:
        self.ranks = ranks
        self.device = torch.device("cpu")  # where results arrive
        self.precision = resolve_precision(precision, torch.device("cuda" if gpus else "cpu"))
        self.dtype = self.precision.weights
        self._configure(optim, loss, max_tokens_per_micro_batch, entropy_metric)

    @classmethod
    def start(
        cls,
        placed: Placed,
        model: str | os.PathLike[str] = "smollm2-135m",
        *,
        device: str | None = None,
        release: bool = False,
        **kwargs: Any,
    ) -> TrainerGroup:
        """One :class:`TorchRank` per trainer bundle of ``placed``, each a
        :class:`~trainer.TorchBackend` of ``model`` with ``kwargs`` (its arguments) on
        ``device``: ``cuda`` (the rank's GPU) or ``cpu``; default ``cuda`` when the
        bundles hold GPUs. ``release``: give the placement back on :meth:`close`."""
        spec = TorchSpec(str(model), kwargs)
        ranks: RankGroup[TorchRank] = RankGroup(
            TorchRank, spec, placed, device=device, release=release
        )
        keep = ("optim", "loss", "max_tokens_per_micro_batch", "entropy_metric", "precision")
        gpus = (device or ("cuda" if placed.placement.gpus else "cpu")) == "cuda"
        return cls(ranks, gpus=gpus, **{k: v for k, v in kwargs.items() if k in keep})

    @property
    def world_size(self) -> int:
        """Data-parallel ranks."""
        return self.ranks.world_size

    def logprobs(
        self, samples: Sequence[Sample], *, reference: bool = False, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        n = self.world_size
        size = -(-len(samples) // n) if samples else 0
        parts = [list(samples[r * size : (r + 1) * size]) for r in range(n)]
        kwargs = {"reference": reference, "temperature": temperature}
        out = self.ranks.call_each(TorchRank.logprobs, [((part,), kwargs) for part in parts])
        return [lp for part in out for lp in part]

    def memory_metrics(self) -> dict[str, float]:
        """The largest rank process's peak resident set so far (GiB)."""
        each = self.ranks.call_each(_peak_rss, [((), {})] * self.world_size)
        return {"perf/peak_rss_gib/trainer_ranks": max(each)}

    def _rank0(self, method: Any, *args: Any) -> Any:
        idle: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})
        return self.ranks.call_each(
            _on_rank0, [((method, args), {})] + [idle] * (self.world_size - 1)
        )[0]

    def weight_sender(self, rank: int = 0) -> RankSender:
        """Rank ``rank``'s weight sender: weight updates leave from its actor (every rank
        holds the same weights)."""
        return RankSender(self.ranks, rank)

    def rank_on(self, bundle_index: int) -> int | None:
        """The rank in placement bundle ``bundle_index`` (None: no rank there)."""
        for rank, bundle in enumerate(self.ranks.bundles):
            if bundle.index == bundle_index:
                return rank
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0's HF-named weights (on CPU)."""
        out: dict[str, torch.Tensor] = self._rank0(TorchRank.state_dict)
        return out

    def save_hf(self, directory: str | os.PathLike[str]) -> None:
        self._rank0(TorchRank.save_hf, str(directory))

    def save_checkpoint(self, directory: str | os.PathLike[str], extra: dict[str, Any]) -> None:
        """Rank 0's model, optimizer and RNG state and ``extra`` (the torch backend's
        checkpoint: a run on one device resumes it too)."""
        self._rank0(TorchRank.save_checkpoint, str(directory), extra)

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        extra: dict[str, Any] = self.ranks.call(TorchRank.load_checkpoint, str(directory))
        self.steps = int(self.ranks.call(_steps))
        return extra


def _on_rank0(rank: TorchRank, method: Any = None, args: tuple[Any, ...] = ()) -> Any:
    """Rank 0 runs ``method``; the others nothing (no collective is involved)."""
    if method is None:
        return None
    result = method(rank, *args)
    if isinstance(result, dict) and all(isinstance(v, torch.Tensor) for v in result.values()):
        return {k: v.detach().cpu() for k, v in result.items()}
    return result


def _steps(rank: TorchRank) -> int:
    return rank.steps


def _peak_rss(rank: TorchRank) -> float:
    return peak_rss_gib()
