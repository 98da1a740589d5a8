"""Three hosts on this machine (network namespaces, benchmarks/hosts.py): a
Ray head with the trainer and the engine in one, a rollout worker on each of the other
two. Mid-run one worker host's Ray node is killed; later it is started again. The run
completes; every step trained a full batch, no group twice, no acknowledged group lost;
the dead host's episodes were played again on the other; its replacement worker joined
once the host was back."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from agentenv import Rubric, State, Task
from benchmarks.hosts import Hosts, available, popen
from tests.trainer.test_loop import GoodTokensEnv, good_tokens, tiny_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

STEPS = 8
BATCH = 4  # prompts per step
N = 2  # samples per prompt


def _logged(task: Task, state: State) -> float:
    """Scores as GoodTokensEnv; notes where each episode was scored (its host's address)."""
    import os
    import time

    import ray

    time.sleep(0.25)  # a verifier that takes its time: rounds last seconds
    hold = os.environ.get("AGENTENV_TEST_HOLD", "")
    while hold and os.path.exists(hold):  # the test holds the run while a host is away
        time.sleep(0.1)
    ip = ray.util.get_node_ip_address()
    with open(os.environ.get("AGENTENV_TEST_SCORED", "/dev/null"), "a") as f:
        f.write(f"{ip} {task.id}\n")
    return good_tokens(task, state)


class HostLoggingEnv(GoodTokensEnv):
    rubric = Rubric(_logged)

    def __init__(self) -> None:
        super().__init__()
        # Notes the host of each process that builds it (a rollout worker, as it starts).
        built = os.environ.get("AGENTENV_TEST_BUILT")
        if built:
            import ray

            with open(built, "a") as f:
                f.write(f"{ray.util.get_node_ip_address()}\n")


def _wait_for(path: Path, lines: int, proc: object, timeout: float, key: str | None = None) -> None:
    """Until ``path`` has ``lines`` lines (with ``key``: until a line's ``key`` is
    positive)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = path.read_text().splitlines() if path.exists() else []
        if key is None and len(found) >= lines:
            return
        if key is not None and any(json.loads(x).get(key, 0) > 0 for x in found):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {lines} steps")
        time.sleep(0.5)
    raise TimeoutError(f"{path} did not reach {lines} lines in {timeout:g} s")


def _wait_for_line(path: Path, text: str, count: int, proc: object, timeout: float) -> None:
    """Until ``path`` has ``count`` lines that are ``text``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = path.read_text().splitlines() if path.exists() else []
        if found.count(text) >= count:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {path} had {count} lines {text!r}")
        time.sleep(0.5)
    raise TimeoutError(f"{path} did not have {count} lines {text!r} in {timeout:g} s")


def test_a_run_survives_losing_a_worker_host_and_takes_it_back(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "tiny")
    save = tmp_path / "run"
    scored = tmp_path / "scored.txt"
    built = tmp_path / "built.txt"
    # Node deaths noticed within seconds (the defaults wait about 30 s).
    fast = {
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
        "RAY_health_check_initial_delay_ms": "1000",
        "AGENTENV_TEST_SCORED": str(scored),
        "AGENTENV_TEST_HOLD": str(tmp_path / "hold"),
        "AGENTENV_TEST_BUILT": str(built),
    }
    with Hosts(3) as hosts:
        head = hosts.ray_head(0, port=6390, num_cpus=3, env=fast)
        for i in (1, 2):
            # One CPU each: the placement's two bundles pack onto the head's three.
            hosts.ray_worker(i, head, num_cpus=1, resources={"rollout": 1}, env=fast)
        hosts.wait_nodes(0, head, 3)
        root = Path(__file__).resolve().parents[3]
        cmd = [
            sys.executable, "-m", "agentenv", "train", "--env", f"{__name__}:HostLoggingEnv",
            "--hf-checkpoint", str(model), "--device", "cpu", "--ray-address", head,
            "--rollout-num-gpus", "1", "--rollout-engine", "serve",
            "--rollout-num-workers", "2", "--rollout-worker-resource", "rollout",
            "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N),
            "--rollout-max-response-len", "4", "--num-rollout", str(STEPS), "--n-eval", "0",
            "--no-use-tensorboard", "--save", str(save), "--json",
        ]  # fmt: skip
        path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
        env = {**os.environ, "PYTHONPATH": str(root), "PATH": path, **fast}
        log = (tmp_path / "train.log").open("w")
        run = popen(hosts, 0, cmd, stdout=log, stderr=log, env=env, cwd=str(root))
        try:
            _wait_for(save / "metrics.jsonl", 1, run, timeout=300)
            # The episodes wait (their verifier holds) while host 2 is lost and comes back,
            # so that the run is still going when its replacement worker can join.
            (tmp_path / "hold").touch()
            hosts.kill_node(2)  # mid-run: step 2's rounds are playing
            hosts.wait_nodes(0, head, 2)  # the cluster saw it die
            hosts.ray_worker(2, head, num_cpus=1, resources={"rollout": 1}, env=fast)
            hosts.wait_nodes(0, head, 3)
            # The replacement built its environment on the host that came back (its first
            # worker did too): it is up, and joins at the next round's start.
            _wait_for_line(built, hosts.address(2), 2, run, timeout=300)
            (tmp_path / "hold").unlink()
            run.wait(timeout=400)
        finally:
            hosts.stop(run)
            log.close()
        output = (tmp_path / "train.log").read_text()
        assert run.returncode == 0, output[-4000:]
    metrics = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    batches = [json.loads(x) for x in (save / "batches.jsonl").read_text().splitlines()]
    assert len(metrics) == len(batches) == STEPS
    groups = [g["group"] for b in batches for g in b["groups"]]
    assert len(groups) == len(set(groups)) == STEPS * BATCH  # none twice, none lost
    assert all(g["samples"] == N for b in batches for g in b["groups"])
    assert [b["step"] for b in batches] == list(range(STEPS))
    last = metrics[-1]
    assert last["rollout/worker_restarts"] >= 1 and last["rollout/worker_retries"] >= 1
    assert last["rollout/workers_alive"] == 2  # the replacement joined on the host that came back
    where = Counter(line.split()[0] for line in scored.read_text().splitlines())
    assert set(where) >= {hosts.address(1), hosts.address(2)}  # both hosts played
    # Every trained episode was scored; the dead host's part was played again (retries).
    assert sum(where.values()) >= STEPS * BATCH * N
    assert "is dead" in output and "again on rollout worker" in output
