"""environments/openenv.py against the real ``openenv`` package (its own venv, made by
``make test``): the echo environment ``openenv init`` ships, a small game built with
OpenEnv's server (``openenv_servers/guess_server.py``), and servers that misbehave."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentenv import (
    ChatTokenizer,
    ConfigError,
    ListSink,
    Sample,
    ScriptedModel,
    Status,
    Task,
    run_rollouts,
)
from environments.openenv import OpenEnvEnv, OpenEnvError, _Slot, render_observation, text_action

ROOT = Path(__file__).resolve().parents[2]
OPENENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
SERVERS = Path(__file__).parent / "openenv_servers"

pytestmark = pytest.mark.timeout(300)


def uvicorn(app: str) -> list[str]:
    return [str(OPENENV_PYTHON), "-m", "uvicorn", app, "--port", "{port}"]


@pytest.fixture(scope="session")
def openenv_python() -> Path:
    if not OPENENV_PYTHON.exists():
        pytest.fail(f"{OPENENV_PYTHON} is missing: run `make .venv-openenv/.installed`")
    return OPENENV_PYTHON


@pytest.fixture(scope="session")
def echo_env(openenv_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The echo environment OpenEnv's ``openenv init`` writes, unchanged."""
    out = tmp_path_factory.mktemp("openenv")
    cli = openenv_python.parent / "openenv"
    subprocess.run([str(cli), "init", "echo_env", "-o", str(out)], check=True, timeout=120,
                   capture_output=True)  # fmt: skip
    return out / "echo_env"


def guess_env(**kwargs: object) -> OpenEnvEnv:
    return OpenEnvEnv(
        server=uvicorn("guess_server:app"),
        cwd=SERVERS,
        max_turns=3,
        **kwargs,  # type: ignore[arg-type]
    )


def task_of(ctx: Any) -> str:
    assert ctx.rid is not None
    return ctx.rid.split("/")[0].split("@")[0]


async def play(
    env: OpenEnvEnv, tokenizer: ChatTokenizer, tasks: list[Task], script: object
) -> dict[str, Sample]:
    sink = ListSink()
    try:
        await run_rollouts(
            env, tasks, ScriptedModel(tokenizer, script),  # type: ignore[arg-type]
            tokenizer=tokenizer, sink=sink,
        )  # fmt: skip
    finally:
        await env.aclose()
    return {str(s.group_id).split("@")[0]: s for s in sink.samples}


def test_defaults_map_text_both_ways() -> None:
    assert text_action()("hi") == {"message": "hi"}
    assert text_action("code")("x = 1") == {"code": "x = 1"}
    assert render_observation({"echoed_message": "hi", "done": False, "metadata": {}}) == "hi"
    assert render_observation({"a": 1, "b": "x", "c": "y"}) == '{"a": 1, "b": "x", "c": "y"}'


@pytest.mark.anyio
async def test_the_echo_environment_plays_through_openenvs_client(
    echo_env: Path, smollm2: ChatTokenizer
) -> None:
    env = OpenEnvEnv(server=uvicorn("server.app:app"), cwd=echo_env, max_turns=2)
    samples = await play(env, smollm2, env.tasks()[:2], [(".*", "hello")])
    assert len(samples) == 2
    for s in samples.values():
        # The echo server never says done: max_turns ends it; each step's reward is 0.5.
        assert s.status is Status.TRUNCATED and s.reason == "max_turns: reached 2 turns"
        assert s.reward == pytest.approx(1.0)
        assert s.metadata["openenv_steps"] == 2
        text = smollm2.decode(list(s.prompt_ids) + list(s.completion_ids))
        assert "Echo Env environment ready!" in text
        assert text.count("hello") == 3  # two replies and the one echo between them


@pytest.mark.anyio
async def test_done_ends_the_episode_and_rewards_sum(smollm2: ChatTokenizer) -> None:
    def script(ctx: Any) -> str:
        seed = int(task_of(ctx).split("-")[1])
        return f"My guess is {seed % 3 + 1}" if task_of(ctx).startswith("right") else "Maybe 9"

    # The user's own parser: the last word of the reply is the guess.
    env = guess_env(action=lambda reply: {"message": reply.split()[-1]})
    tasks = [Task(id="right-4", info={"seed": 4}), Task(id="wrong-5", info={"seed": 5})]
    samples = await play(env, smollm2, tasks, script)
    right, wrong = samples["right-4"], samples["wrong-5"]
    assert right.status is Status.COMPLETED and right.reward == 1.0
    assert right.metadata["openenv_steps"] == 1 and right.metadata["openenv_done"] is True
    assert wrong.status is Status.COMPLETED and wrong.reward == 0.0
    assert wrong.metadata["openenv_steps"] == 3  # the server's done after three guesses
    assert "9 is wrong. Guess again." in smollm2.decode(list(wrong.completion_ids))


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ("die", r"step: .*the OpenEnv server exited with code 3"),
        ("hang", r"step: the OpenEnv server did not answer within step_timeout_s=2 s"),
    ],
)
async def test_a_server_that_dies_or_hangs_fails_that_episode_only(
    smollm2: ChatTokenizer, reply: str, reason: str
) -> None:
    def script(ctx: Any) -> str:
        return reply if task_of(ctx) == "bad" else "2"

    env = guess_env(step_timeout_s=2.0)
    tasks = [Task(id="bad", info={"seed": 1}), Task(id="good", info={"seed": 1})]
    samples = await play(env, smollm2, tasks, script)
    bad, good = samples["bad"], samples["good"]
    assert bad.status is Status.FAILED and bad.error_type == "OpenEnvError"
    assert re.search(reason, bad.reason or ""), bad.reason
    # One slot: the next episode ran on a restarted server.
    assert good.status is Status.COMPLETED and good.reward == 1.0


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("import time; time.sleep(120)", r"was not ready within ready_timeout_s=2 s"),
        (
            "import sys; sys.exit('no such environment')",
            r"exited with code 1 before it was ready.*no such environment",
        ),
    ],
)
async def test_a_server_that_never_becomes_ready_is_named(
    smollm2: ChatTokenizer, code: str, reason: str
) -> None:
    env = OpenEnvEnv(server=[sys.executable, "-c", code, "{port}"], ready_timeout_s=2.0)
    samples = await play(env, smollm2, env.tasks()[:2], [(".*", "1")])
    assert len(samples) == 2
    for s in samples.values():
        assert s.status is Status.FAILED
        assert re.search(reason, s.reason or ""), s.reason


@pytest.fixture
def not_openenv() -> Iterator[str]:
    """An HTTP server that is healthy but is no OpenEnv server: it answers garbage."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html>hello</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.anyio
async def test_a_server_that_answers_garbage_fails_the_episode(
    smollm2: ChatTokenizer, not_openenv: str
) -> None:
    env = OpenEnvEnv(url=not_openenv)
    samples = await play(env, smollm2, env.tasks()[:1], [(".*", "1")])
    (s,) = samples.values()
    assert s.status is Status.FAILED, s.reason
    assert s.error_type == "OpenEnvError", s.error_type
    assert (s.reason or "").startswith("reset: ConnectionError"), s.reason


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        ({"observation": "text", "reward": 0, "done": False}, "observation is not an object"),
        ({"observation": {}, "reward": "1", "done": False}, "reward is not a finite number"),
        ({"observation": {}, "reward": float("nan"), "done": False}, "not a finite number"),
        ({"observation": {}, "reward": 1, "done": "yes"}, "done is not a boolean"),
    ],
)
def test_an_answer_that_is_not_openenvs_is_named(answer: dict[str, object], named: str) -> None:
    with pytest.raises(OpenEnvError, match=named):
        _Slot._parse("step", answer)


def test_eval_with_a_scripted_model(echo_env: Path, tmp_path: Path) -> None:
    script = tmp_path / "hello.json"
    script.write_text(json.dumps({"rules": [], "default": "hello"}))
    args = {"server": uvicorn("server.app:app"), "cwd": str(echo_env), "max_turns": 2}
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "eval", "--env", "environments.openenv:OpenEnvEnv",
         "--env-args", json.dumps(args), "--model", f"scripted:{script}", "--n", "3",
         "--out", str(tmp_path / "samples.jsonl"), "--json"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert all(r["status"] == "truncated" and r["reward"] == pytest.approx(1.0) for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_two_steps_on_cpu(echo_env: Path, tmp_path: Path) -> None:
    from tests._train import train_two_steps

    # The echo server's reward is 0.1 a character of the reply, up to 1: replies of two
    # tokens are short enough for two samples to differ.
    args = {"server": uvicorn("server.app:app"), "cwd": str(echo_env), "max_turns": 1}
    lines = train_two_steps(
        "environments.openenv:OpenEnvEnv", tmp_path / "run", "--env-args", json.dumps(args),
        "--rollout-max-response-len", "2",
    )  # fmt: skip
    assert all(m["failed_episodes"] == 0 and m["samples"] == 2 for m in lines)
    trained = [m for m in lines if "train/grad_norm" in m]  # a step whose groups tie skips
    assert trained and all(m["train/grad_norm"] > 0 for m in trained)
    # The trainer's log-probs of the recorded ids are the engine's: the samples are exact.
    assert all(m["train/rollout_train_logprob_abs_diff"] < 1e-4 for m in trained)


def test_a_bad_configuration_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exactly one of server="):
        OpenEnvEnv()
    with pytest.raises(ConfigError, match="exactly one of server="):
        OpenEnvEnv(server=["x"], url="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="non-empty list of arguments"):
        OpenEnvEnv(server="python -m uvicorn app:app")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="step_timeout_s must be positive"):
        OpenEnvEnv(url="http://127.0.0.1:1", step_timeout_s=0)
    env = OpenEnvEnv(url="http://127.0.0.1:1", openenv_python=str(tmp_path / "python"))
    with pytest.raises(ConfigError, match=r"does not exist; create it with `make \.venv-openenv"):
        env.check()
