"""megatron's parallelism flags, passed through with their own names."""

from __future__ import annotations

import dataclasses
import shlex
import warnings

import pytest

from agentenv import ConfigError
from tests.trainer.megatron.tiny import TINY
from trainer.megatron import MEGATRON_FLAGS, ParallelConfig, parse_megatron_flags

HF = {**TINY, "architectures": ["LlamaForCausalLM"]}


def _to_flags(cfg: ParallelConfig) -> list[str]:
    """The megatron flags that reproduce ``cfg`` (defaults left out)."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value != getattr(ParallelConfig(), f.name):
            flag = "--" + f.name.replace("_", "-")
            out += [flag] if isinstance(value, bool) else [flag, str(value)]
    return out


def test_parses_megatron_flags() -> None:
    line = (
        "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 "
        "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1 --make-vocab-size-divisible-by 64"
    )
    cfg = parse_megatron_flags(shlex.split(line))
    assert cfg == ParallelConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        use_distributed_optimizer=True,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        make_vocab_size_divisible_by=64,
    )
    assert parse_megatron_flags(_to_flags(cfg)) == cfg
    assert parse_megatron_flags([]) == ParallelConfig()


def test_sequence_parallel_is_off_without_tensor_parallelism_as_in_megatron() -> None:
    assert not parse_megatron_flags(["--sequence-parallel"]).sequence_parallel


def test_layout_feeds_the_model_config_and_the_transformer_config() -> None:
    flags = parse_megatron_flags(["--tensor-model-parallel-size", "4", "--sequence-parallel"])
    model = flags.model_config(HF)
    assert model.tensor_model_parallel_size == 4 and model.padded_vocab_size == 512
    kwargs = model.transformer_config_kwargs(**flags.transformer_config_overrides())
    assert kwargs["sequence_parallel"] is True and kwargs["context_parallel_size"] == 1
    assert flags.data_parallel_size(8) == 2


def test_unknown_flags_are_named_with_the_supported_ones() -> None:
    with pytest.raises(ConfigError) as info:
        parse_megatron_flags(
            ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
        )
    message = str(info.value)
    assert "'--expert-model-parallel-size', '2'" in message
    assert all(flag in message for flag in MEGATRON_FLAGS)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--tensor-model-parallel-size", "two"], "invalid int value: 'two'"),
        (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be an integer"),
        (["--recompute-granularity", "some"], "invalid choice: 'some'"),
        (["--recompute-granularity", "full"], "needs --recompute-method"),
        (["--recompute-method", "block"], "apply to --recompute-granularity full only"),
        (["--overlap-param-gather"], "needs --use-distributed-optimizer and --overlap-grad-reduce"),
        (["--tensor-model"], "unsupported megatron flag"),  # no abbreviations
    ],
)
def test_bad_values_and_combinations(flags: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_megatron_flags(flags)


def test_world_size_and_context_parallelism_checks() -> None:
    flags = parse_megatron_flags(
        ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
    )
    with pytest.raises(
        ConfigError, match=r"world size 6 is not a multiple of TP × PP × CP = .* = 4"
    ):
        flags.data_parallel_size(6)
    with pytest.raises(ConfigError, match="--context-parallel-size 2 needs Transformer Engine"):
        flags.model_config(HF)
    assert (
        flags.model_config(HF, transformer_impl="transformer_engine").tensor_model_parallel_size
        == 2
    )


def test_flags_match_megatrons_own_parser() -> None:
    """Every supported flag means in megatron's parser what it means here."""
    with warnings.catch_warnings():  # megatron warns at import about optional packages
        warnings.simplefilter("ignore")
        pytest.importorskip("megatron.training.arguments", exc_type=ImportError)
    from trainer.megatron import megatron_args

    flags = [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--context-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--overlap-param-gather", "--recompute-granularity", "full",
        "--recompute-method", "block", "--recompute-num-layers", "2",
        "--make-vocab-size-divisible-by", "64",
    ]  # fmt: skip
    ours, theirs = parse_megatron_flags(flags), megatron_args(flags)
    for flag in MEGATRON_FLAGS:
        name = flag[2:].replace("-", "_")
        assert getattr(theirs, name) == getattr(ours, name), flag
    defaults, mine = megatron_args([]), ParallelConfig()
    for flag in MEGATRON_FLAGS:
        name = flag[2:].replace("-", "_")
        assert getattr(defaults, name) == getattr(mine, name), flag
