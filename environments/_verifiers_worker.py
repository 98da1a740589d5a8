"""The worker process behind :class:`environments.verifiers.VerifiersEnv`.

Runs in the interpreter that has PrimeIntellect's ``verifiers`` (0.4.x, its ``verifiers.v1``
API) installed -- a virtualenv of its own, because verifiers pins an ``openai`` older than
agentenv's -- so it imports only the standard library and verifiers, never agentenv.

Protocol: one JSON object per line. Started as ``python -P _verifiers_worker.py SETTINGS``
(``{"env": <EnvConfig dict>, "max_concurrency": n, "memory_mb": m, "list": bool}``), it
loads the environment the way ``vf.load_environment`` does and answers ``{"ready": true,
"tasks": [<prompt text>, ...]}`` or ``{"fatal": "<why>"}`` (then exits). With ``list`` it
exits after that line. Otherwise each further line is an episode, ``{"id": k, "task": i,
"base_url": url, "model": name}``, run concurrently (at most ``max_concurrency`` at once)
with verifiers' own harness and rubric, its model calls sent to ``base_url``; each is
answered by ``{"id": k, "ok": bool, "reward": float, "turns": n, "error": "<why>" | null}``.
A line ``{"cancel": k}`` cancels episode ``k`` (its caller gave up on it: a timeout, a
cancelled run), which is then never answered, so its harness and its slot are freed at once
rather than at verifiers' own timeout. End of stdin ends the worker.
"""

from __future__ import annotations

import asyncio
import functools
import json
import resource
import sys
import traceback
from typing import Any

_API_KEY_VAR = "AGENTENV_VERIFIERS_API_KEY"


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _prompt_text(task: Any) -> str:
    prompt = getattr(task.data, "prompt", "")
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, default=str)


def _reason(episode: Any) -> str | None:
    errors = [*episode.errors]
    for trace in episode.traces:
        errors.extend(trace.errors)
    if not errors and episode.ok:
        return None
    if not errors:
        return "verifiers marked the episode failed without an error"
    return "; ".join(f"{e.type}: {e.message}" for e in errors)


def _forget(running: dict[int, Any], key: int, _: object) -> None:
    running.pop(key, None)


async def _serve(vf: Any, env: Any, tasks: list[Any], max_concurrency: int) -> None:
    from verifiers.v1.env import RunSlot

    semaphore = asyncio.Semaphore(max_concurrency)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: dict[int, asyncio.Task[None]] = {}

    async def episode(request: dict[str, Any]) -> None:
        answer: dict[str, Any] = {"id": request["id"], "ok": False, "reward": 0.0, "turns": 0}
        try:
            ctx = vf.ModelContext(
                model=request["model"],
                client=vf.EvalClientConfig(base_url=request["base_url"], api_key_var=_API_KEY_VAR),
            )
            slot = RunSlot(tasks[int(request["task"]) % len(tasks)])
            done = await env.run_slot(slot, ctx, semaphore)
            answer["ok"] = bool(done.ok)
            answer["reward"] = sum(t.reward for t in done.traces) / max(len(done.traces), 1)
            answer["turns"] = sum(t.num_turns for t in done.traces)
            answer["error"] = _reason(done)
        except (Exception, SystemExit) as e:  # an episode's failure is its answer only
            # (verifiers raises SystemExit for a missing Prime login, deep inside a run)
            answer["error"] = f"{type(e).__name__}: {e}"
        _emit(answer)

    async with env.serving():
        while line := await reader.readline():
            request = json.loads(line)
            if "cancel" in request:
                cancelled = running.get(int(request["cancel"]))
                if cancelled is not None:
                    cancelled.cancel()
                continue
            key = int(request["id"])
            running[key] = task = asyncio.create_task(episode(request))
            task.add_done_callback(functools.partial(_forget, running, key))
        await asyncio.gather(*running.values(), return_exceptions=True)


def main() -> int:
    settings = json.loads(sys.argv[1])
    memory_mb = settings.get("memory_mb")
    if memory_mb:
        # Inherited by the harness programs and tool servers verifiers starts, so one
        # runaway process is stopped by its own allocation failing, not the OOM killer.
        limit = int(memory_mb) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import os

    os.environ.setdefault(_API_KEY_VAR, "agentenv")
    try:
        import verifiers.v1 as vf
        from verifiers.v1.utils.loaders import resolve_env_config

        # The EnvConfig narrowed to the environment class its ids resolve to, as `vf eval`.
        env = vf.load_environment(resolve_env_config(settings["env"]))
        tasks = list(env.taskset)
        if not tasks:
            raise ValueError("its taskset has no tasks")
    except Exception as e:
        _emit({"fatal": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return 1
    _emit({"ready": True, "tasks": [_prompt_text(t) for t in tasks]})
    if settings.get("list"):
        return 0
    asyncio.run(_serve(vf, env, tasks, int(settings.get("max_concurrency", 1))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
