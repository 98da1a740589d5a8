"""The training config tree: each field declares its flag once, and the CLI, the flat and
nested config forms and the error messages all come from those declarations."""

from __future__ import annotations

import argparse
import typing

import pytest

from agentenv import ConfigError
from trainer import (
    AGGREGATIONS,
    ESTIMATORS,
    KL_TYPES,
    SCHEDULES,
    GRPOConfig,
    LossConfig,
    TrainConfig,
)
from trainer.run._config import flag_table
from trainer.run._flags import add_train_arguments, config_from_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentenv train")
    add_train_arguments(parser)
    return parser


def test_every_flag_is_declared_once_and_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tree's declarations reach ``--help`` (how a flag renders: agentenv's generator,
    tests/agentenv/cli/test_help.py)."""
    table = flag_table()
    assert len({f.name for f in table.values()}) == len(table)
    monkeypatch.setenv("COLUMNS", "200")
    help_of: dict[str, str] = {}
    for line in _parser().format_help().splitlines():  # an option, then its help lines
        if line.startswith("  --"):
            name = line.split()[0].rstrip(",")
            help_of[name] = line
        elif line.startswith("      ") and help_of:
            help_of[name] += " " + line.strip()
    for flag in table.values():
        if flag.cli:
            assert flag.name in help_of, flag.name
    assert "Adam beta1 [>= 0.0, < 1.0] (default: 0.9)" in help_of["--adam-beta1"]
    assert help_of["--kl-loss-type"].startswith("  --kl-loss-type {k1,k2,k3,low_var_kl}")


def test_slimes_dynamic_batch_size_switch_is_accepted_and_changes_nothing() -> None:
    """Micro-batches are always packed by --max-tokens-per-gpu: slime's switch for that
    is accepted (its scripts run unchanged) and sets nothing."""
    from trainer import config_from_flags

    assert config_from_flags(["--env", "x", "--use-dynamic-batch-size"]) == config_from_flags(
        ["--env", "x"]
    )


def test_the_choices_are_the_components_names() -> None:
    def choices(model: type, field: str) -> tuple[str, ...]:
        annotation = model.model_fields[field].annotation
        return typing.get_args(annotation)

    assert choices(GRPOConfig, "advantage_estimator") == ESTIMATORS
    assert choices(GRPOConfig, "schedule") == SCHEDULES
    assert choices(LossConfig, "kl_type") == KL_TYPES
    assert choices(LossConfig, "aggregation") == AGGREGATIONS


def test_the_loss_flags_reach_the_loss() -> None:
    argv = [
        "--env", "x", "--eps-clip-c", "3", "--use-tis", "--tis-clip-low", "0.5",
        "--tis-clip", "1.5", "--use-kl-loss", "--kl-loss-coef", "0.1",
        "--calculate-per-token-loss", "--rollout-temperature", "0.7",
    ]  # fmt: skip
    loss = config_from_args(_parser().parse_args(argv)).algorithm
    assert (loss.dual_clip, loss.use_tis, loss.tis_clip_low, loss.tis_clip_high) == (
        3.0, True, 0.5, 1.5,
    )  # fmt: skip
    assert (loss.kl_coef, loss.aggregation) == (0.1, "per_token")
    # The temperature is the rollouts' alone (the loop hands it to the backend).
    assert config_from_args(_parser().parse_args(argv)).rollout.sampling.temperature == 0.7
    assert "temperature" not in LossConfig.model_fields
    # As slime: the coefficient without --use-kl-loss adds nothing (and loads no reference).
    assert TrainConfig(env="x", kl_loss_coef=0.1).algorithm.kl_coef == 0.0


def test_the_flat_form_is_the_tree_by_the_flags_names() -> None:
    config = TrainConfig(
        env="x", rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=4,
        num_steps_per_rollout=2, calculate_per_token_loss=True, eps_clip_high=0.3,
        optimizer="sgd", lr_decay_style="cosine", backend="megatron",
        megatron_args=["--tensor-model-parallel-size", "1"], rollout_engine="sglang",
        sglang_args=["--tp-size", "1"], save="runs/a",
    )  # fmt: skip
    flat = config.flat()
    assert flat["calculate_per_token_loss"] is True and flat["optimizer"] == "sgd"
    assert TrainConfig.model_validate(flat) == config
    nested = TrainConfig.model_validate(config.model_dump())
    assert nested == config


def test_errors_name_the_flag_and_the_value() -> None:
    with pytest.raises(
        ConfigError, match="--rollout-batch-size: Input should be greater than or equal to 1, got 0"
    ):
        TrainConfig(env="x", rollout_batch_size=0)
    with pytest.raises(ConfigError, match=r"--eps-clip-high \(0.1\) must be >= --eps-clip \(0.2\)"):
        TrainConfig(env="x", eps_clip_high=0.1)
    with pytest.raises(ConfigError, match=r"--rollout-temperature \(temperature\) must be non-neg"):
        TrainConfig(env="x", rollout_temperature=-1.0)
    with pytest.raises(ConfigError, match="--load needs --save"):
        TrainConfig(env="x", load="runs/a")
    with pytest.raises(ConfigError, match=r"--min-lr \(0.1\) must be <= --lr \(0.01\)"):
        TrainConfig(env="x", lr=0.01, min_lr=0.1)


def test_the_engines_gpus_become_sglangs_tensor_parallelism() -> None:
    config = TrainConfig(
        env="x", rollout_engine="sglang", rollout_num_gpus_per_engine=2, rollout_device="cuda:2"
    )
    assert config.engine.sglang_command_args() == ["--base-gpu-id", "2", "--tp-size", "2"]
    with pytest.raises(ConfigError, match="needs --rollout-engine sglang without --rollout-url"):
        TrainConfig(env="x", rollout_num_gpus_per_engine=2)
    # NCCL: the server's GPUs (2 from cuda:1) may not hold a trainer's (cuda:0, cuda:1).
    with pytest.raises(ConfigError, match="needs the server on a GPU of its own"):
        TrainConfig(
            env="x", rollout_engine="sglang", rollout_num_gpus_per_engine=2, device="cuda",
            rollout_device="cuda:1", weight_sync="distributed", backend="megatron",
            actor_num_gpus_per_node=2,
        )  # fmt: skip


def test_the_groups_pickle_for_the_trainer_ranks() -> None:
    import pickle

    from trainer import OptimConfig

    for group in (LossConfig(use_kl_loss=True, kl_loss_coef=0.1), OptimConfig(adam_beta2=0.95)):
        assert pickle.loads(pickle.dumps(group)) == group


def test_the_placement_flags_decide_whether_a_run_uses_ray() -> None:
    assert not TrainConfig(env="x").uses_ray  # one process, as always
    two = TrainConfig(env="x", actor_num_gpus_per_node=2)  # torch: two data-parallel ranks
    assert two.uses_ray and two.trainer_ranks == 2
    assert TrainConfig(env="x", ray_address="local").uses_ray
    assert TrainConfig(env="x", actor_num_nodes=2).trainer_ranks == 2
    with pytest.raises(ConfigError, match="is not a multiple of --rollout-num-gpus-per-engine 2"):
        TrainConfig(env="x", rollout_engine="sglang", rollout_num_gpus_per_engine=2,
                    rollout_num_gpus=3)  # fmt: skip
    with pytest.raises(ConfigError, match=r"but --rollout-device, --weight-sync distributed are"):
        TrainConfig(env="x", colocate=True, rollout_engine="serve", rollout_device="cpu",
                    weight_sync="distributed")  # fmt: skip
    with pytest.raises(ConfigError, match="--rollout-url names a running server"):
        TrainConfig(env="x", rollout_num_gpus=1, rollout_url="http://10.0.0.2:30000")
    for good in ("auto", "local", "10.0.0.1:6379", "ray://head:10001"):
        assert TrainConfig(env="x", ray_address=good).placement.ray_address == good


def test_engines_on_ray_are_servers_and_router_flags_need_them() -> None:
    """``--rollout-num-gpus`` runs each engine as a Ray actor around a server, so the
    embedded engine is refused; ``--router-*`` flags are for the router before them."""
    from trainer import TrainConfig

    with pytest.raises(ConfigError, match="--rollout-num-gpus runs the engines as Ray actors"):
        TrainConfig(env="arithmetic", rollout_num_gpus=1)
    with pytest.raises(ConfigError, match=r"--router-\* flags \(--policy round_robin\)"):
        TrainConfig(env="arithmetic", router_args=["--policy", "round_robin"])
    config = TrainConfig(
        env="arithmetic", rollout_num_gpus=1, rollout_engine="serve",
        router_args=["--policy", "round_robin"],
    )  # fmt: skip
    assert config.uses_ray and config.engine.router_args == ["--policy", "round_robin"]


def test_offloading_the_rollout_is_for_the_embedded_engine_on_the_sync_schedule() -> None:
    """The embedded engine on CPU gives its memory back for each step's training unless told
    not to; elsewhere only when asked; with episodes running through training (another
    schedule) or for a server of its own, asking is refused."""

    class Embedded:
        def __init__(self, device: str | None) -> None:
            self.device = device

    rollout = TrainConfig(env="x").rollout
    assert rollout.offload_rollout is None
    assert rollout.offloads(Embedded("cpu")) and not rollout.offloads(Embedded("cuda"))
    assert not rollout.offloads(Embedded(None))  # servers: no device of their own here
    off = TrainConfig(env="x", offload_rollout=False).rollout
    assert not off.offloads(Embedded("cpu"))
    assert TrainConfig(env="x", offload_rollout=True).rollout.offloads(Embedded("cuda"))
    assert not GRPOConfig(schedule="one_step_off").offloads(Embedded("cpu"))
    with pytest.raises(ConfigError, match="--offload-rollout with --schedule async"):
        GRPOConfig(schedule="async", offload_rollout=True)
    with pytest.raises(ConfigError, match="--offload-rollout is for the embedded engine"):
        TrainConfig(env="x", offload_rollout=True, rollout_engine="serve")
