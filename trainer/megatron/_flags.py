"""megatron's own parallelism flags, passed through under their own names.

The backend reads a typed subset, :class:`ParallelConfig`, without importing megatron
(``--tensor-model-parallel-size 2 --sequence-parallel …`` parses the same on a laptop and
on a GPU node); the rules megatron applies to them are applied here too. The supported
flags are :class:`ParallelConfig`'s fields (megatron's names, types and defaults).

:func:`megatron_args` parses the same flags -- or any other megatron flag -- with
megatron's own parser (``megatron.training.arguments``, shipped in the megatron-core
wheel; it needs Python >= 3.12).
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from agentenv import ConfigError
from trainer.megatron._config import MegatronModelConfig, TransformerImpl

__all__ = ["MEGATRON_FLAGS", "ParallelConfig", "megatron_args", "parse_megatron_flags"]

_GRANULARITIES = ("full", "selective")
_METHODS = ("uniform", "block")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """The parallel layout and memory settings, with megatron's flag names (``_`` for ``-``).

    Args:
        tensor_model_parallel_size: TP ranks [--tensor-model-parallel-size].
        pipeline_model_parallel_size: PP stages [--pipeline-model-parallel-size].
        context_parallel_size: CP ranks; > 1 needs Transformer Engine's attention
            [--context-parallel-size].
        sequence_parallel: shard activations outside attention/MLP across TP ranks; off
            when TP is 1, as megatron does [--sequence-parallel].
        use_distributed_optimizer: shard optimizer state over data-parallel ranks
            [--use-distributed-optimizer].
        overlap_grad_reduce: overlap the gradient reduce with the backward
            [--overlap-grad-reduce].
        overlap_param_gather: overlap the parameter all-gather with the forward
            [--overlap-param-gather].
        recompute_granularity: activation recomputation, ``full`` or ``selective``
            [--recompute-granularity].
        recompute_method: ``uniform`` or ``block`` (``full`` only) [--recompute-method].
        recompute_num_layers: layers per recompute unit (``full`` only)
            [--recompute-num-layers].
        make_vocab_size_divisible_by: the vocabulary is padded to a multiple of this
            times TP [--make-vocab-size-divisible-by].
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "make_vocab_size_divisible_by",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{_flag(name)} must be an integer >= 1, got {value!r}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # megatron's own rule: sequence parallelism is off without tensor parallelism.
            object.__setattr__(self, "sequence_parallel", False)
        if self.overlap_param_gather and not (
            self.use_distributed_optimizer and self.overlap_grad_reduce
        ):
            raise ConfigError(
                "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"
            )
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if g is not None and g not in _GRANULARITIES:
            raise ConfigError(f"--recompute-granularity must be one of {_GRANULARITIES}, got {g!r}")
        if m is not None and m not in _METHODS:
            raise ConfigError(f"--recompute-method must be one of {_METHODS}, got {m!r}")
        if n is not None and n < 1:
            raise ConfigError(f"--recompute-num-layers must be >= 1, got {n}")
        if g == "full" and (m is None or n is None):
            raise ConfigError(
                "--recompute-granularity full needs --recompute-method (uniform or block) "
                "and --recompute-num-layers"
            )
        if g != "full" and (m is not None or n is not None):
            raise ConfigError(
                f"--recompute-method and --recompute-num-layers apply to "
                f"--recompute-granularity full only, got granularity {g!r}"
            )

    @property
    def model_parallel_size(self) -> int:
        """GPUs one model replica spans: TP × PP × CP."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    def data_parallel_size(self, world_size: int) -> int:
        """Model replicas on ``world_size`` GPUs; an error when the layout does not fit."""
        if world_size < 1 or world_size % self.model_parallel_size:
            raise ConfigError(
                f"world size {world_size} is not a multiple of TP × PP × CP = "
                f"{self.tensor_model_parallel_size} × {self.pipeline_model_parallel_size} × "
                f"{self.context_parallel_size} = {self.model_parallel_size}"
            )
        return world_size // self.model_parallel_size

    def model_config(
        self, hf_config: Any, *, transformer_impl: TransformerImpl = "local"
    ) -> MegatronModelConfig:
        """The model mapped for this layout (see :meth:`MegatronModelConfig.from_hf`)."""
        if self.context_parallel_size > 1 and transformer_impl != "transformer_engine":
            raise ConfigError(
                f"--context-parallel-size {self.context_parallel_size} needs Transformer "
                "Engine's attention; megatron's local attention has no context parallelism"
            )
        return MegatronModelConfig.from_hf(
            hf_config,
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
            transformer_impl=transformer_impl,
        )

    def transformer_config_overrides(self) -> dict[str, Any]:
        """This layout's fields of megatron's ``TransformerConfig`` (TP and PP come with
        :meth:`MegatronModelConfig.transformer_config_kwargs`)."""
        return {
            "context_parallel_size": self.context_parallel_size,
            "sequence_parallel": self.sequence_parallel,
            "recompute_granularity": self.recompute_granularity,
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
        }


def _flag(name: str) -> str:
    return name.replace("_", "-")


#: The megatron flags :func:`parse_megatron_flags` understands.
MEGATRON_FLAGS: tuple[str, ...] = tuple(
    f"--{_flag(f.name)}" for f in dataclasses.fields(ParallelConfig)
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print and exit
        raise ConfigError(f"megatron flags: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="megatron flags", allow_abbrev=False, add_help=False)
    for f in dataclasses.fields(ParallelConfig):
        flag = f"--{_flag(f.name)}"
        if f.type == "bool":
            p.add_argument(flag, action="store_true", dest=f.name)
        elif f.name == "recompute_granularity":
            p.add_argument(flag, choices=_GRANULARITIES, dest=f.name)
        elif f.name == "recompute_method":
            p.add_argument(flag, choices=_METHODS, dest=f.name)
        else:
            p.add_argument(flag, type=int, dest=f.name)
    return p


def parse_megatron_flags(flags: Sequence[str]) -> ParallelConfig:
    """Parse megatron-native flags (see the table above) into a :class:`ParallelConfig`.

    A flag outside the supported set is an error naming it and listing the supported
    ones; megatron's rules between flags are checked.
    """
    args, unknown = _parser().parse_known_args(list(flags))
    if unknown:
        raise ConfigError(
            f"unsupported megatron flag(s) {unknown}; supported: {', '.join(MEGATRON_FLAGS)}"
        )
    given = {k: v for k, v in vars(args).items() if v is not None and v is not False}
    return ParallelConfig(**given)


def megatron_args(flags: Sequence[str]) -> argparse.Namespace:
    """``flags`` parsed by megatron's own argument parser (every megatron flag, with
    megatron's defaults for the rest); not validated against each other (megatron's
    ``validate_args`` needs a full training setup).

    Raises :class:`MegatronNotInstalledError` where ``megatron.training.arguments`` does
    not import (no megatron-core, or Python < 3.12), and ``ConfigError`` for a flag
    megatron does not know.
    """
    from trainer.megatron._provider import require_megatron

    arguments = require_megatron("megatron.training.arguments")
    parser = _Parser(prog="megatron", allow_abbrev=False, add_help=False)
    with warnings.catch_warnings():
        # megatron 0.19.2 declares a flag in a way Python 3.12's argparse deprecates.
        warnings.simplefilter("ignore", DeprecationWarning)
        arguments.add_megatron_arguments(parser)
    return parser.parse_args(list(flags))
