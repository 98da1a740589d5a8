"""``agentenv train`` (an ``agentenv`` plug-in): GRPO on an environment, on the torch or
the megatron backend (``--backend``).

    agentenv train --env arithmetic --hf-checkpoint smollm2-135m --num-rollout 10 \\
        --rollout-batch-size 8 --n-samples-per-prompt 4 --lr 1e-6 --save runs/a --json
    agentenv train --config run.yaml --schedule async --rollout-engine sglang \\
        --sglang-mem-fraction-static 0.5      # SGLang's own flags, passed through

Flags use slime's names; ``--config FILE`` (YAML, JSON or TOML) holds any of them and
flags override it. The configuration (the batch identity included) is validated before
anything heavy loads. The run evaluates held-out tasks before and after training (greedy
by default), shows a progress bar (step, reward, time split), writes every step's metrics
to ``SAVE/metrics.jsonl`` and TensorBoard (``SAVE/tensorboard``), a checkpoint (model,
optimizer, RNG, position) to ``SAVE/checkpoint`` every ``--save-interval`` steps (10)
and after the last, written in the background, the trained model to ``SAVE/model`` and a
plot to ``SAVE/metrics.png``. Run the same command again (or pass ``--load RUN``) and it
resumes after the last checkpoint. Episodes in flight follow the engines' capacity
(``--rollout-max-running``; SGLang: ``--sglang-server-concurrency`` per server).

Rollouts run on the embedded engine in this process (``--rollout-engine embedded``,
weights synced in memory), on ``agentenv serve`` or SGLang servers launched for the run
(``serve``, ``sglang``; every ``--sglang-*`` flag goes to SGLang), or on running servers
(``--rollout-url``). Servers get the weights through ``/update_weights_from_disk``
(``--weight-sync disk``, a shared filesystem) or broadcast over a process group
(``--weight-sync distributed``: NCCL when the trainer is on CUDA -- the server then needs a
GPU of its own, ``--rollout-device cuda:1`` -- gloo on CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agentenv import ConfigError
from trainer._config import TrainConfig

__all__ = ["TrainConfig", "add_parser"]


def add_parser(sub: Any) -> None:
    from agentenv.cli import add_model_arguments

    parser: argparse.ArgumentParser = sub.add_parser(
        "train",
        help="train a model on an environment with GRPO",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(
        parser,
        TrainConfig,
        config_file=True,
        exclude=("sglang_args", "megatron_args"),
        metavars={
            "env": "NAME",
            "hf_checkpoint": "MODEL",
            "prompt_data": "FILE",
            "input_key": "KEY",
            "label_key": "KEY",
            "save": "DIR",
            "load": "DIR",
            "dynamic_sampling_filter_path": "FUNCTION",
            "rollout_url": "URL",
            "rollout_device": "DEVICE",
            "weight_sync_master_address": "HOST",
            "device": "DEVICE",
        },
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.set_defaults(handler=_main, sglang_passthrough=True, megatron_passthrough=True)


def _main(args: argparse.Namespace) -> int:
    from agentenv.cli import build_config

    if args.router_args:
        print(
            "agentenv train: error: --router-* flags: agentenv train launches no router "
            "(point --rollout-url at a running one)",
            file=sys.stderr,
        )
        return 2
    for name in ("sglang_args", "megatron_args"):
        if not getattr(args, name, None):
            vars(args).pop(name, None)  # the config file's (if any) apply
    config = build_config(TrainConfig, args)
    from trainer._train import train

    try:
        result = train(config)
    except ConfigError as e:
        print(f"agentenv train: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0
