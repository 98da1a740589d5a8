"""MCP servers as tools, against the real ``mcp`` package: a small server of our own
(tests/agentenv/mcp_server.py, the package's server API) over stdio as a subprocess and over
streamable HTTP on 127.0.0.1; a ToolEnv episode and an AgentEnv agent calling its tools; a
server that crashes or hangs mid-call; a tool whose schema agentenv cannot use."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import agentenv
from agentenv import (
    ChatTokenizer,
    ClosedResourceError,
    ConfigError,
    ListSink,
    MCPServer,
    RolloutConfig,
    Rubric,
    Sample,
    ScriptedModel,
    State,
    Status,
    Task,
    ToolEnv,
    run_rollouts,
    run_tool_calls,
    tool,
)
from agentenv._scripted import ScriptContext
from agentenv.endpoint import AgentEnv
from tests._train import even_share, train_two_steps

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

SERVER = str(Path(__file__).with_name("mcp_server.py"))


def stdio_server(tmp_path: Path, **kwargs: Any) -> MCPServer:
    """The test server over stdio; each start appends a line to tmp_path/starts.log."""
    return MCPServer(
        [sys.executable, SERVER], env={"MCP_TEST_LOG": str(tmp_path / "starts.log")}, **kwargs
    )


def starts(tmp_path: Path) -> int:
    log = tmp_path / "starts.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def script(*calls: str) -> Any:
    """Make the k-th tool call of ``calls`` on the model's k-th turn, then answer with the
    last tool message's text."""

    def reply(ctx: ScriptContext) -> str:
        results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", ctx.text, re.DOTALL)
        if len(results) < len(calls):
            return calls[len(results)]
        return f"The answer is {results[-1] if results else 'unknown'}."

    return reply


def says_five(task: Task, state: State) -> float:
    return 1.0 if state.completion == "The answer is 5." else 0.0


def make_env(*servers: MCPServer, local: tuple[Any, ...] = ()) -> ToolEnv:
    class MCPTools(ToolEnv):
        tools = local
        mcp_servers = servers
        rubric = Rubric(says_five)

    return MCPTools()


async def episodes(env: ToolEnv, model: ScriptedModel, n: int = 1) -> list[Sample]:
    sink = ListSink()
    tasks = [Task(id=f"t{i}", prompt="What is 2+3?") for i in range(n)]
    await run_rollouts(env, tasks, model, sink=sink, config=RolloutConfig(concurrency=n))
    return sorted(sink.samples, key=lambda s: s.task_id or "")


def tool_text(s: Sample, tok: ChatTokenizer) -> tuple[str, str]:
    """(the completion's tokens with loss mask 0, those with mask 1), decoded."""
    assert s.loss_mask is not None
    masked = [t for t, m in zip(s.completion_ids, s.loss_mask, strict=True) if not m]
    trained = [t for t, m in zip(s.completion_ids, s.loss_mask, strict=True) if m]
    return tok.decode(masked), tok.decode(trained)


@tool
def double(x: int) -> int:
    """Double a number.

    Args:
        x: the number.
    """
    return 2 * x


async def test_an_episode_calls_an_mcp_tool(
    smollm2: ChatTokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = make_env(stdio_server(tmp_path), local=(double,))
    model = ScriptedModel(smollm2, script(call("add", a=2, b=3)))
    with caplog.at_level(logging.WARNING, logger="agentenv.mcp"):
        (s,) = await episodes(env, model)
    assert s.status is Status.COMPLETED, s.reason
    assert s.reward == 1.0
    assert s.metadata["tool_calls"] == 1 and "tool_errors" not in s.metadata
    # The server's result is a tool message, not trained on; the model's turns are.
    masked, trained = tool_text(s, smollm2)
    assert "<|im_start|>tool\n5<|im_end|>" in masked
    assert "tool\n5" not in trained and trained.endswith("The answer is 5.<|im_end|>")
    # The server's tools and schemas were offered beside the local one; the one whose
    # schema is not JSON Schema was left out, and a warning named it.
    prompt = smollm2.decode(s.prompt_ids)
    for name in ('"name": "add"', '"name": "double"', '"type": "integer"', "Add two integers."):
        assert name in prompt
    assert "fruity" not in prompt
    assert "tool 'fruity' skipped: its input schema is not valid JSON Schema" in caplog.text
    assert starts(tmp_path) == 1


async def test_tool_errors_and_other_content_are_tool_messages(
    smollm2: ChatTokenizer, tmp_path: Path
) -> None:
    calls = [call("add", a="two", b=3), call("fail"), call("picture"), call("add", a=2, b=3)]
    model = ScriptedModel(smollm2, script(*calls))
    (s,) = await episodes(make_env(stdio_server(tmp_path)), model)
    assert s.status is Status.COMPLETED and s.reward == 1.0
    assert s.metadata["tool_calls"] == 4 and s.metadata["tool_errors"] == 2
    masked, _ = tool_text(s, smollm2)
    assert "Error: invalid arguments for 'add': a: 'two' is not of type 'integer'" in masked
    assert "Error: tool 'fail' reported an error: disk on fire" in masked
    assert "[image content (image/png) omitted: tools give the model text only]\na cat" in masked
    assert starts(tmp_path) == 1  # none of these restarts the server


async def test_a_server_that_crashes_mid_call_is_a_tool_error_and_restarted(
    smollm2: ChatTokenizer, tmp_path: Path
) -> None:
    model = ScriptedModel(smollm2, script(call("crash"), call("add", a=2, b=3)))
    (s,) = await episodes(make_env(stdio_server(tmp_path)), model)
    assert s.status is Status.COMPLETED, s.reason
    assert s.reward == 1.0 and s.metadata["tool_errors"] == 1
    masked, _ = tool_text(s, smollm2)
    assert re.search(r"Error: tool 'crash' failed: the MCP server .* broke the connection", masked)
    assert "<|im_start|>tool\n5<|im_end|>" in masked
    assert starts(tmp_path) == 2


async def test_a_server_that_never_answers_times_out_and_is_restarted(
    smollm2: ChatTokenizer, tmp_path: Path
) -> None:
    model = ScriptedModel(smollm2, script(call("hang"), call("add", a=2, b=3)))
    (s,) = await episodes(make_env(stdio_server(tmp_path, timeout_s=1.0)), model)
    assert s.status is Status.COMPLETED, s.reason
    assert s.reward == 1.0 and s.metadata["tool_errors"] == 1
    masked, _ = tool_text(s, smollm2)
    assert "Error: tool 'hang' timed out after 1.0 s" in masked
    assert "<|im_start|>tool\n5<|im_end|>" in masked
    assert starts(tmp_path) == 2


async def test_one_server_per_run_or_one_per_episode(
    smollm2: ChatTokenizer, tmp_path: Path
) -> None:
    model = ScriptedModel(smollm2, script(call("add", a=2, b=3)))
    shared = stdio_server(tmp_path / "shared")
    (tmp_path / "shared").mkdir()
    async with shared:  # held for the whole run: its episodes share one process
        assert [t.name for t in shared.tools][:2] == ["add", "crash"]
        samples = await episodes(make_env(shared), model, n=3)
    assert [s.reward for s in samples] == [1.0] * 3
    assert starts(tmp_path / "shared") == 1
    with pytest.raises(ClosedResourceError, match="is not open"):
        shared.tools  # noqa: B018
    (tmp_path / "fresh").mkdir()
    samples = await episodes(make_env(stdio_server(tmp_path / "fresh", per_episode=True)), model, 3)
    assert [s.reward for s in samples] == [1.0] * 3
    assert starts(tmp_path / "fresh") == 3


async def test_a_name_offered_twice_is_refused_and_a_prefix_fixes_it(
    smollm2: ChatTokenizer, tmp_path: Path
) -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add locally."""
        return a + b

    model = ScriptedModel(smollm2, script(call("srv_add", a=2, b=3)))
    (s,) = await episodes(make_env(stdio_server(tmp_path), local=(add,)), model)
    assert s.status is Status.FAILED and s.error_type == "ConfigError"
    assert "offers two tools named 'add'" in (s.reason or "")
    assert "prefix" in (s.reason or "")
    (s,) = await episodes(make_env(stdio_server(tmp_path, prefix="srv_"), local=(add,)), model)
    assert s.status is Status.COMPLETED and s.reward == 1.0


async def test_a_server_that_does_not_start_fails_the_episode_naming_it(
    smollm2: ChatTokenizer,
) -> None:
    server = MCPServer([sys.executable, "-c", "print('not an MCP server')"])
    (s,) = await episodes(make_env(server), ScriptedModel(smollm2, script()))
    assert s.status is Status.FAILED and s.error_type == "ConfigError"
    assert "could not be started" in (s.reason or "") and "-c print(" in (s.reason or "")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of command"),
        ({"command": ["x"], "url": "http://h/mcp"}, "exactly one of command"),
        ({"command": "python server.py"}, "list of strings"),
        ({"command": []}, "command is empty"),
        ({"url": "localhost:8000"}, "http:// or https:// URL"),
        ({"url": "http://h/mcp", "per_episode": True}, "runs elsewhere"),
        ({"command": ["x"], "timeout_s": 0}, "timeout_s must be a positive number, got 0"),
        ({"command": ["x"], "prefix": "1x"}, "prefix must start"),
    ],
)
def test_bad_server_settings_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MCPServer(**kwargs)


def test_import_agentenv_does_not_load_mcp() -> None:
    import subprocess

    code = (
        "import sys, agentenv; print(sorted({'mcp', 'jsonschema', 'uvicorn'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_tool_env_with_servers_still_needs_a_rubric() -> None:
    class NoReward(ToolEnv):
        mcp_servers = (MCPServer(["x"]),)

    with pytest.raises(ConfigError, match="NoReward has no rubric"):
        NoReward().check()


def test_mcp_servers_must_be_servers() -> None:
    with pytest.raises(ConfigError, match=r"mcp_servers must be a tuple of MCPServer"):

        class One(ToolEnv):
            mcp_servers = MCPServer(["x"])  # type: ignore[assignment]

    with pytest.raises(ConfigError, match=r"mcp_servers must be a tuple of MCPServer, got str"):

        class Text(ToolEnv):
            mcp_servers = "server.py"  # type: ignore[assignment]

    with pytest.raises(ConfigError, match=r"holds str 'server.py', which is not an MCPServer"):

        class Names(ToolEnv):
            mcp_servers = ("server.py",)  # type: ignore[assignment]


@contextlib.asynccontextmanager
async def http_server() -> AsyncIterator[str]:
    """The test server over streamable HTTP, in this event loop, on a free 127.0.0.1 port."""
    import uvicorn

    from tests.agentenv import mcp_server

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # listening now: the client's connections wait until uvicorn accepts them
    port = sock.getsockname()[1]
    config = uvicorn.Config(mcp_server.app(), log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        try:
            yield f"http://127.0.0.1:{port}/mcp"
        finally:
            server.should_exit = True
    sock.close()


async def test_a_streamable_http_server_at_a_url(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, script(call("add", a=2, b=3)))
    async with http_server() as url:
        (s,) = await episodes(make_env(MCPServer(url=url)), model)
    assert s.status is Status.COMPLETED, s.reason
    assert s.reward == 1.0
    masked, _ = tool_text(s, smollm2)
    assert "<|im_start|>tool\n5<|im_end|>" in masked


# -- an AgentEnv agent using an MCP server's tools through its OpenAI client --------------
AGENT_SERVER = MCPServer([sys.executable, SERVER])


class MCPAgent(AgentEnv):
    rubric = Rubric(lambda task, state: 1.0 if state.info["answer"] == "The answer is 5." else 0.0)

    async def run_agent(self, task: Task, client: Any) -> str:
        async with AGENT_SERVER.open() as tools:
            messages: list[Any] = [{"role": "user", "content": str(task.prompt)}]
            for _ in range(3):
                r = await client.chat.completions.create(
                    model="policy", messages=messages, tools=[t.schema for t in tools]
                )
                msg = r.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))
                if not msg.tool_calls:
                    return str(msg.content)
                calls = [
                    agentenv.ToolCall(tc.function.name, json.loads(tc.function.arguments), id=tc.id)
                    for tc in msg.tool_calls
                ]
                messages.extend(await run_tool_calls(calls, tools))
        return ""


def test_an_agent_uses_the_server_in_openai_format(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, script(call("add", a=2, b=3)))
    result = agentenv.run(MCPAgent(), model, tasks=[Task(id="t", prompt="What is 2+3?")])
    (s,) = result.samples
    assert s.status is Status.COMPLETED, s.reason
    assert s.reward == 1.0 and s.metadata["tool_calls"] == 1
    masked, _ = tool_text(s, smollm2)
    assert "<|im_start|>tool\n5<|im_end|>" in masked
    assert '"name": "add"' in smollm2.decode(s.prompt_ids)


# -- docs/ecosystem.md's section: its example is the code in examples/, and its command runs --
ROOT = Path(__file__).resolve().parents[2]


def test_the_ecosystem_doc_shows_the_example_verbatim_and_its_command_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shlex

    from agentenv.cli import main

    doc = (ROOT / "docs" / "ecosystem.md").read_text()
    section = doc.split("## MCP servers as tools\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    for name in ("mcp_calculator_server.py", "mcp_tool_env.py"):
        assert (ROOT / "examples" / name).read_text() in blocks, name
    (command,) = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[0] == "agentenv"
    monkeypatch.chdir(ROOT)
    assert main([*argv[1:], "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["reward_mean"] == 1.0 and summary["episodes"] == 2


# -- two training steps through an MCP tool environment (SmolLM2, CPU) ------------------------
PYTHON_SERVER = (sys.executable, str(ROOT / "examples" / "mcp_calculator_server.py"))


class TrainedMCPEnv(ToolEnv):
    """The example server's tool offered for training; each start of the server is logged
    to $MCP_TEST_LOG."""

    mcp_servers = (
        MCPServer(
            ["sh", "-c", 'echo start >> "$MCP_TEST_LOG" && exec "$0" "$1"', *PYTHON_SERVER],
            env={"MCP_TEST_LOG": os.environ.get("MCP_TEST_LOG", os.devnull)},
        ),
    )
    max_turns = 2
    rubric = Rubric(even_share)

    def tasks(self, split: str = "train") -> list[Task]:
        return [Task(id=f"t{i}", prompt=f"What is {i}+3?") for i in range(4)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_agentenv_train_trains_two_steps_with_an_mcp_tool_env(tmp_path: Path) -> None:
    log = tmp_path / "starts.log"
    lines = train_two_steps(
        f"{__name__}:TrainedMCPEnv", tmp_path / "run", env_vars={"MCP_TEST_LOG": str(log)}
    )
    assert all(m["failed_episodes"] == 0 and m["samples"] == 2 for m in lines)
    trained = [m for m in lines if "train/grad_norm" in m]  # a step whose groups tie skips
    assert trained and all(m["train/grad_norm"] > 0 for m in trained)
    # The trainer's log-probs of the recorded ids are the engine's: the samples are exact.
    assert all(m["train/rollout_train_logprob_abs_diff"] < 1e-4 for m in trained)
    # The episodes were played with the server's tools: it was started (by the first
    # episode of each batch of episodes running together).
    assert log.read_text().splitlines().count("start") >= 2
