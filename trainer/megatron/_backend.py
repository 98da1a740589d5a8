"""The megatron-core training backend: an HF Llama/Qwen2 model converted into megatron's
``GPTModel`` and trained with the shared GRPO loss on megatron's own machinery.

    backend = MegatronBackend("path/to/hf", optim=OptimConfig(lr=1e-6))
    metrics = backend.train_step(samples, advantages)

    # 4 GPUs: tensor parallel 2 × data parallel 2 (megatron's flags, its names)
    backend = MegatronBackend(
        "path/to/hf", num_gpus=4,
        parallel=parse_megatron_flags(["--tensor-model-parallel-size", "2"]),
    )

The class wires the three parts the package docstring names: it checks the options,
starts the ranks through its ``launcher`` and runs every method on all of them. The new
weights leave as HF tensors gathered on rank 0 (:meth:`state_dict`) or an HF safetensors
directory (:meth:`save_hf`); checkpoints hold every rank's model shard and megatron's
optimizer state.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentenv import ConfigError, Sample
from trainer._resources import replace_dir
from trainer.backends import RanksBackend, checkpoint_meta
from trainer.config import LossConfig, OptimConfig
from trainer.distributed import LocalRanks, Ranks
from trainer.megatron._config import MegatronModelConfig
from trainer.megatron._flags import ParallelConfig
from trainer.megatron._provider import require_megatron
from trainer.megatron._setup import MegatronOptions, resolve_options
from trainer.megatron._worker import MegatronWorker

if TYPE_CHECKING:
    from trainer.backends import WeightSender
    from trainer.distributed import Placed

__all__ = ["Launcher", "MegatronBackend", "launch_ranks", "ray_launcher"]

#: Starts a backend's ranks, each building a :class:`MegatronWorker` from the options.
Launcher = Callable[[MegatronOptions], Ranks[MegatronWorker]]


def launch_ranks(options: MegatronOptions) -> Ranks[MegatronWorker]:
    """The default :data:`Launcher`: one GPU, the rank in this process on
    ``options.device``; ``options.num_gpus`` > 1, one Ray actor per GPU on a placement of
    that many GPUs on the cluster Ray finds (a running one, else a new one here), given
    back when the ranks close."""
    require_megatron()
    if not options.device.startswith("cuda") or not torch.cuda.is_available():
        raise ConfigError(
            f"the megatron backend needs a CUDA device (megatron-core does not run on "
            f"CPU), got device {options.device!r}; use the torch backend there"
        )
    if options.num_gpus == 1:
        first = torch.device(options.device)
        index = torch.cuda.current_device() if first.index is None else first.index
        torch.cuda.set_device(index)
        return LocalRanks(MegatronWorker, options, index)
    from trainer.distributed import Placement, RankGroup, connect

    ray = connect(None)
    placed = Placement(actor_num_gpus_per_node=options.num_gpus).place(ray)
    return RankGroup(MegatronWorker, options, placed, device="cuda", release=True)


def ray_launcher(placed: Placed) -> Launcher:
    """A :data:`Launcher` of one Ray actor per trainer bundle of ``placed`` (a run's
    placement, :class:`trainer.distributed.Placement`)."""
    from trainer.distributed import RankGroup

    def launch(options: MegatronOptions) -> Ranks[MegatronWorker]:
        require_megatron()
        if placed.placement.actor_gpus != options.num_gpus:
            raise ConfigError(
                f"the placement has {placed.placement.actor_gpus} trainer GPUs but num_gpus "
                f"is {options.num_gpus}: pass the same"
            )
        return RankGroup(MegatronWorker, options, placed, device="cuda")

    return launch


class MegatronBackend(RanksBackend):
    """Trains a Llama- or Qwen2-architecture HF model on megatron-core (CUDA only).

    Args:
        model: a model name (``smollm2-135m``) or an HF directory.
        device: ``cuda`` or ``cuda:N`` (one GPU: its; more: the ranks' GPUs are the
            placement's).
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
        launcher: starts the ranks (:data:`Launcher`); default :func:`launch_ranks`
            (:func:`ray_launcher` for a run's placement).

    ``model``, ``reference`` and ``optimizer`` are rank 0's, where rank 0 runs in this
    process (one GPU).
    """

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
        launcher: Launcher | None = None,
    ) -> None:
        options = resolve_options(
            model, device=device, dtype=dtype, optim=optim, loss=loss,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch, parallel=parallel,
            num_gpus=num_gpus, entropy_metric=entropy_metric, seed=seed,
            attention=attention, qkv_format=qkv_format,
        )  # fmt: skip
        self.dp_size = options.data_parallel_size
        self.parallel = options.parallel
        self.dtype = options.dtype
        self.cfg: MegatronModelConfig = options.parallel.model_config(options.path)
        self._configure(optim, loss, max_tokens_per_micro_batch, entropy_metric)
        self.ranks: Ranks[MegatronWorker] = (launcher or launch_ranks)(options)
        local = self.ranks.local
        self.device = local.device if local is not None else torch.device(options.device)

    # -- rank 0's objects -----------------------------------------------------------------
    def _local(self) -> MegatronWorker:
        local = self.ranks.local
        if local is None:
            raise AttributeError("rank 0 runs in another process: its model is not here")
        return local

    @property
    def model(self) -> Any:
        """Rank 0's model (megatron's ``DistributedDataParallel``)."""
        return self._local().model

    @property
    def reference(self) -> Any:
        """Rank 0's frozen reference model, or ``None`` (loaded when ``loss.kl_coef > 0``)."""
        return self._local().reference

    @property
    def optimizer(self) -> Any:
        """Rank 0's megatron optimizer (a ChainedOptimizer)."""
        return self._local().optimizer

    # -- collective: every rank runs these --------------------------------------------------
    def logprobs(
        self, samples: Sequence[Sample], *, reference: bool = False, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        return self.ranks.call(
            MegatronWorker.logprobs, samples, reference=reference, temperature=temperature
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named weights, merged from megatron's layout (vocabulary padding stripped);
        gathered on rank 0."""
        return self.ranks.call(MegatronWorker.state_dict)

    def weight_sender(self) -> WeightSender:
        """Ranks on Ray: the weights are gathered on rank 0 (a collective of every rank)
        and leave from its actor; one rank here: from this process."""
        from trainer.distributed import RankGroup, RankSender

        if isinstance(self.ranks, RankGroup):
            return RankSender(self.ranks, 0, collective=True)
        return super().weight_sender()

    def save_hf(self, directory: str | os.PathLike[str]) -> None:
        self.ranks.call(MegatronWorker.save_hf, directory)

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

    def save_checkpoint(self, directory: str | os.PathLike[str], extra: dict[str, Any]) -> None:
        """Every rank's model shard and optimizer state, rank 0's RNG and ``extra``."""
        with replace_dir(directory) as tmp:
            self.ranks.call(MegatronWorker.save_shards, str(tmp.resolve()))
            torch.save(
                {"torch_rng": torch.get_rng_state(), "steps": self.steps},
                tmp / "trainer_state.pt",
            )
            (tmp / "checkpoint.json").write_text(
                json.dumps({"model": self._identity(), "extra": extra}, indent=1)
            )

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        root = Path(directory)
        meta = checkpoint_meta(root, self._identity())
        state = torch.load(root / "trainer_state.pt", weights_only=False)
        torch.set_rng_state(state["torch_rng"])
        steps = int(state["steps"])
        self.ranks.call(MegatronWorker.load_shards, str(root.resolve()), steps)
        self.steps = steps
        extra: dict[str, Any] = meta.get("extra", {})
        return extra
