"""slime's GLM-Z1-9B launch script trains one step on the CPU: its flags as
``tests/trainer/test_dry_run.py`` keeps them, adapted only in paths, model and sizes, on a
JSONL in slime's format scored by ``--rm-type deepscaler`` (no ``--env``). megatron's own
flags and ``--ref-load`` stay out: the torch backend refuses them (tested there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.test_dry_run import SLIME_GLM_Z1_9B

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# path, model and size changes; None: the flag is megatron's (refused on --backend torch).
ADAPTED: dict[str, str | None] = {
    "--hf-checkpoint": "smollm2-135m",
    "--ref-load": None,
    "--load": "{run}",
    "--save": "{run}",
    "--prompt-data": "{prompts}",
    "--num-rollout": "1",
    "--rollout-batch-size": "2",
    "--n-samples-per-prompt": "2",
    "--rollout-max-response-len": "24",
    "--global-batch-size": "4",
    "--tensor-model-parallel-size": None,
    "--sequence-parallel": None,
    "--pipeline-model-parallel-size": None,
    "--context-parallel-size": None,
    "--rollout-num-gpus-per-engine": "1",
}


def adapted_script() -> list[str]:
    out: list[str] = []
    for group in SLIME_GLM_Z1_9B.values():
        i = 0
        while i < len(group):
            flag = group[i]
            has_value = i + 1 < len(group) and not group[i + 1].startswith("--")
            value = group[i + 1] if has_value else None
            i += 2 if has_value else 1
            if flag in ADAPTED:
                new = ADAPTED[flag]
                if new is None:
                    continue
                value = new if has_value else None
            out += [flag] if value is None else [flag, value]
    return out


def test_the_adaptation_changes_only_paths_model_and_sizes() -> None:
    kept = [a for g in SLIME_GLM_Z1_9B.values() for a in g if a.startswith("--")]
    dropped = {f for f, v in ADAPTED.items() if v is None}
    assert [a for a in adapted_script() if a.startswith("--")] == [
        f for f in kept if f not in dropped
    ]
    assert dropped == {"--ref-load", "--tensor-model-parallel-size", "--sequence-parallel",
                       "--pipeline-model-parallel-size", "--context-parallel-size"}  # fmt: skip


def test_slimes_script_trains_one_step_on_the_cpu(tmp_path: Path) -> None:
    prompts = tmp_path / "dapo-math-17k.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i} + {i}? Put the answer in "
                     "\\boxed{} after your reasoning in <think></think>."}],
         "label": str(2 * i)}
        for i in range(8)
    ]  # fmt: skip
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    argv = [a.format(run=run, prompts=prompts) for a in adapted_script()]
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "train", *argv, "--json"],
        capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["steps"] == 1
    assert 0.0 <= report["train_reward_first"] <= 1.0  # deepscaler's 0/1 rewards
    assert (run / "checkpoint" / "checkpoint.json").is_file()
