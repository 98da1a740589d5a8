"""The benchmark's 3-turn ``add`` tool-use episode, driven through PrimeIntellect's ``verifiers``.

``agentenv bench rollout`` compares the SDK's own per-turn overhead with verifiers' on the same
episode: a system + user prompt asks for ``a + b + c``; an instant fake model answers turn 1 with
an OpenAI-format call ``add(a, b)``, turn 2 with ``add(<result>, c)``, turn 3 with plain text
quoting the last tool result; the reward is 1.0 iff that text states the right sum. The fake
model reads the numbers it passes on from the tool results in the request, so a reward of 1.0
proves the tool really ran and the rubric really scored.

Written against verifiers 0.4.x, whose only API is the ``verifiers.v1`` stack (the old
``ToolEnv``/``MultiTurnEnv``/``Rubric`` classes are gone). There an episode is
``Env.run_slot(RunSlot(task), ModelContext)`` inside ``env.serving()`` -- exactly what
``vf-eval`` does per rollout -- and it is built from:

* a ``Taskset`` of ``Task`` rows whose ``@vf.reward`` method is the rubric;
* the ``add`` tool as a ``vf.Toolset``: an MCP server in its own process, reached over
  loopback HTTP. It is taskset-scoped (one server for the run); a task-scoped toolset would
  also start one server process per rollout;
* a harness: the program that plays the agent. Stock verifiers runs the tool-less chat loop
  (harness ``null``) as a uv-managed Python *subprocess per rollout* (``--harness null``):
  ~2.5 CPU-s of imports and ~100 MB per in-flight rollout, so it cannot reach concurrency
  1024 on a small machine. The default, ``--harness inproc``, runs the same bundled
  chat-loop source inside this process instead -- the ``Harness.launch`` contract allows
  that -- which measures verifiers' framework overhead without its process-per-rollout
  cost, i.e. the comparison most favourable to verifiers;
* the interception server: an in-process aiohttp server the harness's OpenAI client talks to;
  it records each turn into the trace and forwards it to the real client.

The fake model sits at the last hop: verifiers' own ``EvalClient`` (the relay used for
evaluation) gets an ``httpx.MockTransport`` that answers each chat-completions request with
canned SSE bytes, so everything verifiers does per turn runs and nothing leaves the machine.
Training mode (``TrainClient``) is not used: it renders prompts with a real model's tokenizer
from the Hugging Face hub and calls a vLLM ``/inference/v1/generate`` engine.

Runnable on its own, so the benchmark can drive it from a separate virtualenv::

    python -m benchmarks.verifiers_episode --concurrency 64 --episodes 2000

prints one JSON line. The module imports without verifiers installed; verifiers is imported
lazily inside the functions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.metadata
import json
import os
import re
import resource
import shutil
import sys
import threading
import time
import types
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["run_verifiers_bench", "verifiers_available"]

_MODULE = "benchmarks.verifiers_episode"
# verifiers resolves tasksets and harnesses by id, importing `verifiers.v1.tasksets.<id>` or
# `<id>`; a dotted id such as this module's name breaks the first probe, so the plugin classes
# are published under these flat, synthetic module names instead.
_TASKSET_ID = "agentenv_vf_add_taskset"
_INPROC_HARNESS_ID = "agentenv_vf_inproc_harness"
_FAKE_MODEL = "agentenv-fake-model"
_SUPPORTED_SERIES = "0.4."
_HARNESSES = ("inproc", "null")
# Measured peak RSS of one stock `null` chat-program process (openai + mcp imported).
_NULL_RSS_PER_ROLLOUT = 100 * 2**20
_NUM_TASKS = 64
_SYSTEM_PROMPT = "You are a careful calculator. Always use the add tool for arithmetic."
_INT = re.compile(r"-?\d+")
# The repository root, so tool-server subprocesses (`python -m <this module>`) can import it.
_REPO_ROOT = Path(__file__).resolve().parents[1]


def verifiers_available() -> str | None:
    """None if this interpreter can run the verifiers episode, else a one-line reason why not."""
    try:
        version = importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        return "verifiers is not installed in this interpreter (pip install verifiers==0.4.0)"
    if not version.startswith(_SUPPORTED_SERIES):
        return f"verifiers {version} found; this driver targets the 0.4.x verifiers.v1 API"
    try:
        importlib.import_module("verifiers.v1")
        importlib.import_module("verifiers.v1.harnesses.null")
        importlib.import_module("mcp")
    except Exception as e:  # any import-time failure makes the comparison impossible
        return f"verifiers {version} does not import: {type(e).__name__}: {e}"
    return None


def _uv() -> str | None:
    """uv next to this interpreter (a venv's bin/) or on PATH."""
    local = Path(sys.executable).with_name("uv")
    return str(local) if local.exists() else shutil.which("uv")


# --- the fake model -------------------------------------------------------------------------


def _fake_turn(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The instant model's reply to one chat-completions request: (delta, finish_reason).

    Turn 1 calls ``add(a, b)``, turn 2 ``add(<turn-1 result>, c)``, turn 3 states the turn-2
    result; the operands come from the request itself, so a wrong tool result shows up as a
    wrong final answer rather than being papered over by a script."""
    messages: list[dict[str, Any]] = body["messages"]
    user = next(m for m in messages if m.get("role") == "user")
    a, b, c = (int(x) for x in _INT.findall(_text(user.get("content")))[:3])
    results = [_last_int(_text(m.get("content"))) for m in messages if m.get("role") == "tool"]
    if len(results) >= 2:
        return {"role": "assistant", "content": f"The answer is {results[-1]}."}, "stop"
    x, y = (a, b) if not results else (results[0], c)
    call = {
        "index": 0,
        "id": f"call_{len(results) + 1}",
        "type": "function",
        "function": {"name": "add", "arguments": json.dumps({"a": x, "b": y})},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"


def _text(content: Any) -> str:
    """Chat message content (a string or a list of text parts) as plain text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _last_int(text: str) -> int | None:
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def _fake_completion_bytes(body: dict[str, Any]) -> tuple[bytes, str]:
    """Serialize the fake reply the way an OpenAI-compatible server would: SSE chunks ending
    in a usage chunk and ``[DONE]`` when the request streams, else one ``chat.completion``."""
    delta, finish = _fake_turn(body)
    head = {"id": "chatcmpl-fake", "created": 0, "model": body.get("model", _FAKE_MODEL)}
    usage = {"prompt_tokens": 64, "completion_tokens": 16, "total_tokens": 80}
    if body.get("stream"):
        chunk = {
            **head,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        tail = {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}
        sse = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(tail)}\n\ndata: [DONE]\n\n"
        return sse.encode(), "text/event-stream"
    message = dict(delta)
    if "tool_calls" in message:
        message["tool_calls"] = [
            {k: v for k, v in call.items() if k != "index"} for call in message["tool_calls"]
        ]
    completion = {
        **head,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
    }
    return json.dumps(completion).encode(), "application/json"


@contextlib.contextmanager
def _fake_upstream() -> Iterator[None]:
    """Swap the HTTP client verifiers' ``EvalClient`` builds for one whose transport is the
    fake model, so the relay, SSE framing and parsing code all still run."""
    import httpx
    from verifiers.v1.clients import eval as eval_client

    async def handle(request: httpx.Request) -> httpx.Response:
        content, content_type = _fake_completion_bytes(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": content_type}, content=content)

    def build(config: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.MockTransport(handle),
            timeout=httpx.Timeout(**config.timeout.model_dump()),
        )

    original = eval_client.build_async_httpx
    eval_client.build_async_httpx = build
    try:
        yield
    finally:
        eval_client.build_async_httpx = original


# --- the verifiers plugin: taskset, task, toolset, in-process harness ----------------------


@cache
def _plugin() -> types.SimpleNamespace:
    """Define the verifiers classes (verifiers imported only here) and publish them under the
    flat module names verifiers' plugin loader resolves."""
    import verifiers.v1 as vf
    from verifiers.v1.harnesses.null import NullHarness

    class AddToolset(vf.Toolset[vf.SharedToolsetConfig]):  # type: ignore[misc]
        """The episode's one tool, served over MCP by ``python -m`` this module."""

        TOOL_PREFIX = None  # advertise the tool as plain `add`, as the fake model calls it

        @vf.tool  # type: ignore[untyped-decorator]
        async def add(self, a: int, b: int) -> int:
            """Add two integers."""
            return a + b

    class AddData(vf.TaskData):  # type: ignore[misc]
        answer: int

    class AddTask(vf.Task[AddData]):  # type: ignore[misc]
        @vf.reward  # type: ignore[untyped-decorator]
        async def correct(self, trace: Any) -> float:
            """1.0 iff the final reply states the right sum."""
            return 1.0 if _last_int(trace.last_reply) == self.data.answer else 0.0

    class AddTasksetConfig(vf.TasksetConfig):  # type: ignore[misc]
        num_tasks: int = _NUM_TASKS

    class AddTaskset(vf.Taskset[AddTask, AddTasksetConfig]):  # type: ignore[misc]
        def load(self) -> list[Any]:
            tasks = []
            for i in range(self.config.num_tasks):
                a, b, c = 11 + i, 23 + 2 * i, 7 + 3 * i
                data = AddData(
                    prompt=f"What is {a} + {b} + {c}? Use the add tool, then state the result.",
                    system_prompt=_SYSTEM_PROMPT,
                    answer=a + b + c,
                )
                tasks.append(AddTask(data, self.config.task))
            return tasks

        @classmethod
        def toolsets(cls, config: Any) -> list[Any]:
            return [AddToolset(vf.SharedToolsetConfig())]

    class InprocChatHarness(NullHarness):  # type: ignore[misc]
        """The ``null`` harness's chat program, run in this process instead of as a subprocess.

        Executes the exact bundled program source the subprocess would run and replicates its
        ``main()`` without argv; every model call still goes through the interception
        endpoint and every tool call through MCP, as ``Harness.launch`` requires."""

        async def setup(self, runtime: Any) -> None:
            return None  # nothing to install: the program runs here

        async def launch(
            self,
            ctx: Any,
            trace: Any,
            runtime: Any,
            endpoint: str,
            secret: str,
            mcp_urls: dict[str, str],
            data: Any,
            tool_interception_url: str | None = None,
        ) -> Any:
            program = _chat_program()
            system_prompt, prompt = self.resolve_prompt(data)
            client = program.AsyncOpenAI(
                base_url=endpoint,
                api_key=secret,
                timeout=program.httpx.Timeout(None, connect=5.0),
                http_client=program.DefaultAsyncHttpxClient(verify=program.certifi.where()),
            )
            args = argparse.Namespace(
                api_key=secret,
                tool_interception_url=tool_interception_url or "",
                bash=False,
                edit=False,
                search=False,
                serper_key="",
            )
            config = {
                "mcpServers": {
                    name: {"url": url, "timeout": self.config.tool_timeout}
                    for name, url in mcp_urls.items()
                }
            }
            try:
                async with contextlib.AsyncExitStack() as stack:
                    tools, dispatch, servers = await asyncio.wait_for(
                        program.connect_mcp(config, stack, set()), timeout=60
                    )
                    messages: list[dict[str, Any]] = []
                    if system_prompt:
                        messages.append({"role": "system", "content": system_prompt})
                    messages.append({"role": "user", "content": prompt})
                    compactor = program.Compactor(client, ctx.model, tools, False, None)
                    compactor.note_good(messages)
                    await program.run_chat_loop(args, compactor, messages, dispatch, servers, None)
            finally:
                # The subprocess would just exit; in-process the connection pool must close.
                await client.close()
            return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    # verifiers starts the tool server as `python -m <AddToolset.__module__>`: pin it to the
    # importable name, which it would not be if this file ran as __main__.
    AddToolset.__module__ = _MODULE
    _publish(_TASKSET_ID, AddTaskset=AddTaskset)
    _publish(_INPROC_HARNESS_ID, InprocChatHarness=InprocChatHarness)
    return types.SimpleNamespace(
        vf=vf, toolset=AddToolset, taskset=AddTaskset, taskset_config=AddTasksetConfig
    )


def _publish(module_name: str, **exports: type) -> None:
    """Register a synthetic plugin module exporting `exports` via ``__all__``."""
    module = types.ModuleType(module_name)
    for name, obj in exports.items():
        setattr(module, name, obj)
    module.__all__ = list(exports)  # type: ignore[attr-defined]
    sys.modules[module_name] = module


@cache
def _chat_program() -> types.SimpleNamespace:
    """The ``null`` harness's bundled chat-program source, executed once as a module."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    namespace: dict[str, Any] = {"__name__": "vf_chat_program"}
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), namespace)
    return types.SimpleNamespace(**namespace)


# --- measurement ----------------------------------------------------------------------------


class _TreeRss:
    """Peak summed RSS of this process and all its descendants, sampled from /proc.

    ``ru_maxrss`` covers one process only, and the stock harness puts a Python process per
    in-flight rollout next to this one."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-rss", daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> _TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        total = 0
        for pid in _process_tree():
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * self._page
            except (OSError, ValueError):
                continue  # exited since it was listed
        self.peak_bytes = max(self.peak_bytes, total)


def _process_tree() -> list[int]:
    """This process and its live descendants."""
    found, stack = [], [os.getpid()]
    while stack:
        pid = stack.pop()
        found.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue  # exited since it was listed
    return found


def _tree_cpu_s() -> float:
    """CPU seconds used so far by this process, its reaped children and its live descendants.

    The tool server and (stock harness) the chat programs run in child processes but compete
    for the same cores, so the per-turn CPU cost has to include them. Differences of two
    readings count each child once: a child reaped in between moves from the live sum into
    ``RUSAGE_CHILDREN`` with its whole lifetime."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime + reaped.ru_utime + reaped.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for pid in _process_tree()[1:]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                # Fields after the parenthesised command name; utime and stime are 14 and 15.
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return total


def _mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, None where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _prepare_process_env() -> None:
    """Environment the runtime's subprocesses inherit (the subprocess runtime copies ours).

    Mutates ``os.environ``: the tool server needs this repository on PYTHONPATH, and the
    stock harness needs uv; both only add to what is there."""
    path = os.environ.get("PYTHONPATH", "")
    if str(_REPO_ROOT) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), path) if p)
    # uv must come from this venv and must never download a Python interpreter.
    uv = _uv()
    if uv is not None:
        os.environ["PATH"] = os.pathsep.join((str(Path(uv).parent), os.environ.get("PATH", "")))
    os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")
    os.environ.setdefault("UV_PYTHON", sys.executable)


async def run_verifiers_bench(
    concurrency: int, episodes: int, harness: str = "inproc", warmup: int = 1
) -> dict[str, float]:
    """Run `episodes` 3-turn tool-use episodes through verifiers with at most `concurrency` in
    flight and an instant fake client. Returns {"turns_per_s": ..., "episodes": ...,
    "turns": ..., "wall_s": ..., "reward_mean": ...} plus memory and error counts.

    `harness` is ``"inproc"`` (verifiers' chat program run in this process) or ``"null"``
    (stock: the program as a subprocess per rollout; refused when the in-flight processes
    would not fit in available memory). `warmup` untimed episodes run first, so one-time
    costs (uv preparing the program's environment, imports, the tool server's first call)
    stay out of the timing. The tool server is started before timing too."""
    if harness not in _HARNESSES:
        raise ValueError(f"harness must be one of {_HARNESSES}, not {harness!r}")
    if concurrency < 1 or episodes < 1:
        raise ValueError("concurrency and episodes must be >= 1")
    if harness == "null":
        # Better a clear refusal than the OOM killer picking a victim on a shared machine.
        need = min(concurrency, episodes) * _NULL_RSS_PER_ROLLOUT
        available = _mem_available()
        if available is not None and need > 0.8 * available:
            raise RuntimeError(
                f"harness 'null' at concurrency {concurrency} needs ~{need / 2**30:.0f} GiB "
                f"(a Python process per in-flight rollout); {available / 2**30:.0f} GiB free"
            )
    reason = verifiers_available()
    if reason is not None:
        raise RuntimeError(reason)
    if harness == "null" and _uv() is None:
        # The stock harness prepares its chat program with `uv sync --script`; without uv,
        # verifiers would try to download uv from the internet.
        raise RuntimeError("harness 'null' needs uv next to this Python or on PATH")
    _prepare_process_env()
    plugin = _plugin()
    vf = plugin.vf
    from verifiers.v1.env import RunSlot
    from verifiers.v1.harnesses.null import NullHarnessConfig

    harness_config = (
        NullHarnessConfig(id="null")
        if harness == "null"
        else NullHarnessConfig(id=_INPROC_HARNESS_ID)
    )
    config = vf.SingleAgentEnvConfig(
        taskset=plugin.taskset_config(id=_TASKSET_ID),
        agent=vf.AgentConfig(harness=harness_config, runtime=vf.SubprocessConfig()),
    )
    env = vf.load_environment(config)
    # `api_key_var` other than PRIME_API_KEY keeps verifiers from reading a Prime CLI config.
    ctx = vf.ModelContext(
        model=_FAKE_MODEL,
        client=vf.EvalClientConfig(base_url="http://fake-model.invalid/v1", api_key_var="_"),
    )
    tasks = list(env.taskset)
    semaphore = asyncio.Semaphore(concurrency)

    async def run(n: int, offset: int = 0) -> list[Any]:
        slots = [RunSlot(tasks[(offset + i) % len(tasks)]) for i in range(n)]
        return list(await asyncio.gather(*(env.run_slot(s, ctx, semaphore) for s in slots)))

    with _fake_upstream(), _TreeRss() as tree:
        async with env.serving():
            if warmup:
                await run(warmup)
            cpu_start, start = _tree_cpu_s(), time.perf_counter()
            done = await run(episodes, offset=warmup)
            wall, cpu = time.perf_counter() - start, _tree_cpu_s() - cpu_start
    traces = [trace for episode in done for trace in episode.traces]
    turns = sum(trace.num_turns for trace in traces)
    return {
        "turns_per_s": turns / wall,
        "episodes": float(len(done)),
        "turns": float(turns),
        "wall_s": wall,
        "reward_mean": sum(trace.reward for trace in traces) / max(len(traces), 1),
        "failed_episodes": float(sum(not episode.ok for episode in done)),
        # Wall time per turn is 1 / throughput; CPU time per turn is the cost that concurrency
        # cannot hide (this machine's cores are shared by every process in the tree).
        "wall_us_per_turn": 1e6 * wall / max(turns, 1),
        "cpu_us_per_turn": 1e6 * cpu / max(turns, 1),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_tree_rss_mb": tree.peak_bytes / 2**20,
    }


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--harness", choices=_HARNESSES, default="inproc")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    # Run the importable module, not this __main__ copy, so class __module__ names resolve.
    module = importlib.import_module(_MODULE)
    try:
        result = asyncio.run(
            module.run_verifiers_bench(args.concurrency, args.episodes, args.harness, args.warmup)
        )
    except (RuntimeError, ValueError) as e:
        # Unavailable or refused: still one JSON line, so the parent benchmark can report why.
        print(json.dumps({"error": str(e)}))
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    if "VF_CONFIG" in os.environ:
        # Started by verifiers as this module's tool server (`python -m`, config in the env).
        _plugin().toolset.run()
    else:
        sys.exit(_main())
