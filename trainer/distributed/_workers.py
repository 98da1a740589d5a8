"""Rollout workers on any node: the environments of a run, out of the driver.

Each worker is a CPU-only Ray actor that builds the run's environment itself (from its
name and ``--env-args``, never pickled with state), generates through the router, and
plays the parts of the rounds the driver deals it with :func:`agentenv.run_rollouts`,
putting each group into the run's one Buffer, which the driver serves over HTTP. A part
played again after its worker died names the same groups, so the Buffer takes each once;
a worker that leaks past ``max_worker_rss_mb`` is recycled between rounds
(docs/distributed.md, "rollout workers").

    workers = RolloutWorkers(spec, num_workers=4)
    async with workers.serving(buffer):      # the Buffer served, the workers started
        result = await workers.play(tasks, rollout_config)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from agentenv import ConfigError, RolloutConfig, RolloutStats, Sample, Status, Task
from trainer.distributed._cluster import node_address

__all__ = ["PlayResult", "RolloutWorkers", "WorkerSpec", "check_worker_room"]

log = logging.getLogger("trainer.distributed")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What every rollout worker builds: the environment (``env`` a registered name or
    ``module:Class``, with ``env_args``), the tokenizer (the model directory
    ``tokenizer``, with its chat template or ``chat_template`` in its place), the reward
    flags' rubric in place of the environment's (``reward_args``), the
    policy (``policy_url``: the router or a server, with ``api_key``), and its concurrency
    (episodes in flight per worker)."""

    env: str
    env_args: Mapping[str, Any]
    tokenizer: str
    policy_url: str  # or scripted:<file> (agentenv eval's scripted models: no engine)
    chat_template: str | None = None  # a template in place of the model's
    reward_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    api_key: str | None = None
    concurrency: int = 64
    num_cpus: float = 1.0
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)
    max_worker_rss_mb: float | None = None


@dataclasses.dataclass
class PlayResult:
    """What one round produced, over every worker that played a part of it."""

    stats: RolloutStats = dataclasses.field(default_factory=RolloutStats)
    groups_put: int = 0
    roles: int = 1


@dataclasses.dataclass
class _Part(PlayResult):
    """A worker's answer for one part of a round: what it played, its time, its process's
    resident set now (MB) and at most so far (GiB)."""

    wall_s: float = 0.0
    rss_mb: float = 0.0
    peak_rss_gib: float = 0.0


class RolloutWorker:
    """The body of one worker's actor (async: its own event loop)."""

    def __init__(self, spec: WorkerSpec, buffer_url: str, buffer_token: str) -> None:
        from trainer.config import EnvSpec, build_env

        self.spec = spec
        self.buffer_url = buffer_url
        self.buffer_token = buffer_token
        # Kept, not raised: an actor whose constructor raises dies with the error in a
        # message; :meth:`where` raises it as itself.
        self.error: BaseException | None = None
        try:
            self.env = build_env(EnvSpec(spec.env, spec.env_args, spec.reward_args))
            self.env.check()
            self.tokenizer = _tokenizer(spec)
        except Exception as e:
            self.error = e

    def where(self) -> tuple[str, str, int]:
        """This worker's node id, node address and process id (the environment's error,
        if it could not be built)."""
        import ray

        if self.error is not None:
            raise self.error
        return ray.get_runtime_context().get_node_id(), node_address(), os.getpid()

    async def play(self, tasks: list[Task], config: RolloutConfig) -> _Part:
        from agentenv import run_rollouts
        from agentenv.buffer import BufferClient

        start = time.perf_counter()
        sink = _CountingSink()
        async with (
            _policy(self.spec, self.tokenizer) as policy,
            BufferClient(self.buffer_url, token=self.buffer_token) as buffer,
        ):
            sink.inner = buffer
            stats = await run_rollouts(
                self.env, tasks, policy, tokenizer=self.tokenizer, sink=sink, config=config
            )
        from trainer._resources import peak_rss_gib, rss_mib

        wall_s = time.perf_counter() - start
        return _Part(stats, sink.put, sink.roles, wall_s, rss_mib(), peak_rss_gib())


@contextlib.asynccontextmanager
async def _policy(spec: WorkerSpec, tokenizer: Any) -> AsyncIterator[Any]:
    if spec.policy_url.startswith("scripted:"):
        from agentenv import load_policy

        yield load_policy(spec.policy_url, tokenizer=spec.tokenizer)[0]
        return
    from agentenv.sglang import SGLangClient

    async with SGLangClient(spec.policy_url, api_key=spec.api_key) as client:
        yield client


def _tokenizer(spec: WorkerSpec) -> Any:
    from agentenv import ChatTokenizer

    tokenizer = ChatTokenizer.load(spec.tokenizer)
    return tokenizer if spec.chat_template is None else tokenizer.with_template(spec.chat_template)


class _CountingSink:
    inner: Any = None

    def __init__(self) -> None:
        self.put = 0
        self.roles = 1

    async def put_group(self, samples: Sequence[Sample]) -> None:
        self.roles = max(self.roles, len({s.role for s in samples if s.role is not None}))
        await self.inner.put_group(samples)
        self.put += 1


@dataclasses.dataclass(eq=False)
class _Worker:
    index: int
    actor: Any
    where: str = ""
    dead: bool = False
    episodes: int = 0
    busy_s: float = 0.0
    in_flight: int = 0
    recycle: bool = False  # over its memory limit: replaced after the round
    retrying: anyio.Lock = dataclasses.field(default_factory=anyio.Lock)
    started: Any = None  # the ref of its first ``where()``: set once it has built its env


class RolloutWorkers:
    """``num_workers`` rollout worker actors and the driver's side of their rounds.

    Args:
        spec: what each worker builds.
        num_workers: workers (``--rollout-num-workers``), spread over the nodes that have
            ``spec.num_cpus`` CPUs (and ``spec.resources``) free.
        max_task_retries: times a part of a round is played again after its worker died.
        start_timeout: seconds the workers have to build their environments.
        announce: a directory where the served Buffer is announced while it serves:
            ``buffer.json`` (its URL) and ``buffer.token`` (its bearer token, mode 600),
            for ``agentenv buffer stats DIR/buffer.json``.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        num_workers: int,
        *,
        max_task_retries: int = 2,
        start_timeout: float = 300.0,
        announce: os.PathLike[str] | str | None = None,
    ) -> None:
        if num_workers < 1:
            raise ConfigError(f"num_workers must be at least 1, got {num_workers}")
        if max_task_retries < 0:
            raise ConfigError(f"max_task_retries must be at least 0, got {max_task_retries}")
        self.spec = spec
        self.num_workers = num_workers
        self.max_task_retries = max_task_retries
        self.start_timeout = start_timeout
        self.announce = None if announce is None else Path(announce)
        self._workers: list[_Worker] = []
        self._buffer: Any = None
        self._buffer_url = ""
        self._token = secrets.token_hex(16)
        self._next_index = 0
        self._restarts = 0
        self._retries = 0
        self._failed_parts = 0
        self._recycled = 0
        self._peak_rss_gib = 0.0  # the largest worker process's, over the run
        self._pending: list[_Worker] = []  # replacements not yet placed
        self._failures: Counter[str] = Counter()

    # -- life cycle ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def serving(self, buffer: Any) -> AsyncIterator[RolloutWorkers]:
        """Serve ``buffer`` to the workers and start them; end both on the way out."""
        from agentenv.buffer import BufferServer

        self._buffer = buffer
        host = node_address()  # where the workers reach the driver's Buffer
        refused: ConfigError | None = None
        async with BufferServer(buffer, token=self._token, host=host, port=0) as server:
            self._buffer_url = server.url
            if self.announce is not None:
                self._announce(self.announce)
            try:
                await self._start_all()
            except ConfigError as e:  # raised as itself, not in the server's task group
                refused = e
            else:
                try:
                    yield self
                finally:
                    self._kill_all()
        if refused is not None:
            raise refused

    async def _start_all(self) -> None:
        workers = [self._launch() for _ in range(self.num_workers)]
        try:
            with anyio.fail_after(self.start_timeout):
                for w in workers:
                    await self._ready(w)
        except TimeoutError:
            self._kill(workers)
            ask = ", ".join(f"{k}: {v:g}" for k, v in self._asked().items())
            raise ConfigError(
                f"the {self.num_workers} rollout workers were not all placed within "
                f"{self.start_timeout:g} s (each asks for {{{ask}}}); the cluster has "
                f"{_cluster(self._asked())}: lower --rollout-num-workers or "
                "--rollout-num-cpus-per-worker, or add nodes"
            ) from None
        except BaseException:
            self._kill(workers)
            raise
        self._workers = workers
        where = "; ".join(f"worker {w.index} on {w.where}" for w in workers)
        log.info("%d rollout workers: %s", len(workers), where)

    def _announce(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        token = directory / "buffer.token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._token + "\n")
        (directory / "buffer.json").write_text(json.dumps({"url": self._buffer_url}) + "\n")
        log.info(
            "the run's Buffer is served at %s (agentenv buffer stats %s)",
            self._buffer_url, directory / "buffer.json",
        )  # fmt: skip

    def _asked(self) -> dict[str, float]:
        return {"CPU": self.spec.num_cpus, **self.spec.resources}

    def _launch(self) -> _Worker:
        import ray

        remote: Any = ray.remote(RolloutWorker)
        actor = remote.options(
            num_cpus=self.spec.num_cpus,
            resources=dict(self.spec.resources) or None,
            scheduling_strategy="SPREAD",
            max_concurrency=1000,
        ).remote(self.spec, self._buffer_url, self._token)
        w = _Worker(self._next_index, actor, started=actor.where.remote())
        self._next_index += 1
        return w

    async def _ready(self, w: _Worker) -> None:
        """Until the worker built its environment; its error, as a ConfigError, if not."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            node, ip, pid = await w.started
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else e
            raise ConfigError(
                f"rollout worker {w.index} could not build the environment {self.spec.env!r} "
                f"with --env-args {dict(self.spec.env_args)}: {type(cause).__name__}: {cause}"
            ) from None
        except RayActorError as e:
            raise ConfigError(
                f"rollout worker {w.index} could not start: {_actor_error(e)}"
            ) from None
        w.where = f"node {node[:8]} ({ip}), pid {pid}"

    def _kill(self, workers: Sequence[_Worker]) -> None:
        import ray

        for w in workers:
            with contextlib.suppress(Exception):
                ray.kill(w.actor, no_restart=True)

    def _kill_all(self) -> None:
        self._kill([*self._workers, *self._pending])
        self._workers, self._pending = [], []

    # -- rounds ----------------------------------------------------------------------------
    def live(self) -> list[_Worker]:
        return [w for w in self._workers if not w.dead]

    async def play(self, tasks: Sequence[Task], config: RolloutConfig) -> PlayResult:
        """Play ``tasks`` (``config.n_samples_per_prompt`` episodes each) on the workers,
        every group into the Buffer; what was played. ``config.run_id`` names the round
        (default: from its seed), so a part played again is recognised."""
        await self._adopt_replacements()
        config = dataclasses.replace(
            config,
            run_id=config.run_id or f"s{config.seed}",
            concurrency=max(1, math.ceil(config.concurrency / max(len(self.live()), 1))),
            progress=False,
        )
        result = PlayResult()
        if not tasks:
            return result
        live = self.live()
        if not live:
            raise ConfigError(
                "every rollout worker is dead and none has been replaced yet; the run stops "
                f"({self._restarts} replacements started, failures: {dict(self._failures)})"
            )
        parts = [list(tasks[i :: len(live)]) for i in range(len(live))]
        async with anyio.create_task_group() as tg:
            for w, part in zip(live, parts, strict=False):
                if part:
                    tg.start_soon(self._play_part, w, part, config, result)
        await self._recycle_leaky()
        return result

    async def _play_part(
        self, w: _Worker, tasks: list[Task], config: RolloutConfig, result: PlayResult,
        attempts: int = 0,
    ) -> None:  # fmt: skip
        """``tasks`` on ``w``. If the worker dies, each of the tasks is played again alone
        on the least busy live worker (so a task that kills its workers fails alone), at
        most ``max_task_retries`` times; then its group is put as failed samples."""
        from ray.exceptions import RayActorError, RayTaskError

        episodes = len(tasks) * config.n_samples_per_prompt
        w.in_flight += episodes
        try:
            part: _Part = await w.actor.play.remote(tasks, config)
        except RayActorError as e:
            reason = _actor_error(e)
            self._bury(w, reason)
            attempts += 1
            async with anyio.create_task_group() as tg:
                for task in tasks:
                    if attempts > self.max_task_retries:
                        self._failed_parts += 1
                        await self._put_failed([task], config, reason, attempts, result)
                        continue
                    self._retries += 1
                    tg.start_soon(self._retry, task, config, result, attempts, reason)
            return
        except RayTaskError as e:  # the round itself failed (the Buffer, a bug): stop
            cause = e.cause if isinstance(e.cause, BaseException) else e
            raise cause from None
        finally:
            w.in_flight = max(0, w.in_flight - episodes)
        _merge(result, part)
        w.episodes += part.stats.episodes
        w.busy_s += part.wall_s
        self._peak_rss_gib = max(self._peak_rss_gib, part.peak_rss_gib)
        limit = self.spec.max_worker_rss_mb
        if limit is not None and part.rss_mb > limit:
            w.dead = w.recycle = True  # replaced after the round (its part is done)
            self._recycled += 1
            log.warning(
                "rollout worker %d uses %.0f MB (limit %.0f MB): recycled",
                w.index, part.rss_mb, limit,
            )  # fmt: skip

    async def _retry(
        self, task: Task, config: RolloutConfig, result: PlayResult, attempts: int, reason: str
    ) -> None:
        """``task`` again, alone on its worker (one retried task at a time per worker, so
        a task that kills its workers takes no other retried task with it)."""
        while True:
            w = await self._pick()
            if w is None:
                self._failed_parts += 1
                await self._put_failed([task], config, reason, attempts, result)
                return
            async with w.retrying:
                if w.dead:  # died while this task waited for it: pick again
                    continue
                log.warning(
                    "playing task %s again on rollout worker %d (attempt %d of %d): %s",
                    task.id, w.index, attempts + 1, self.max_task_retries + 1, reason,
                )  # fmt: skip
                await self._play_part(w, [task], config, result, attempts)
                return

    async def _pick(self) -> _Worker | None:
        """The least busy live worker; if none, the first replacement to be up (within
        ``start_timeout``); None if none comes."""
        if not self.live():
            await self._poll_replacements(self.start_timeout, until=lambda: bool(self.live()))
        live = self.live()
        return (
            min(live, key=lambda w: (w.retrying.locked(), w.in_flight, w.index)) if live else None
        )

    def _bury(self, w: _Worker, reason: str) -> None:
        if w.dead:
            return
        w.dead = True
        self._failures[reason.split(":")[0]] += 1
        log.warning("rollout worker %d on %s is dead: %s", w.index, w.where, reason)
        self._replace()

    def _replace(self) -> None:
        """Start a replacement; it joins when Ray places it (maybe when a node returns)."""
        self._pending.append(self._launch())
        self._restarts += 1

    async def wait_ready(self, timeout: float = 300.0) -> None:  # noqa: ASYNC109
        """Until every replacement started so far has joined (at most ``timeout``
        seconds; a node that is not back yet keeps its replacement pending)."""
        await self._poll_replacements(timeout, until=lambda: not self._pending)

    async def _poll_replacements(self, seconds: float, *, until: Callable[[], bool]) -> None:
        """Adopt replacements as Ray places them until ``until()`` or nothing is pending,
        for ``seconds`` at most."""
        with anyio.move_on_after(seconds):
            while self._pending and not until():
                await self._adopt_replacements()
                if self._pending and not until():
                    await anyio.sleep(0.2)  # polls Ray for the replacements' placement

    async def _adopt_replacements(self) -> None:
        """Replacements that are up join; the dead are forgotten."""
        import ray

        still: list[_Worker] = []
        for w in self._pending:
            # Up once its first where() has answered (asked at its launch): known here at
            # once, however long a call to its node takes.
            done, _ = ray.wait([w.started], timeout=0)
            if not done:
                still.append(w)
                continue
            try:
                await self._ready(w)
            except ConfigError as e:
                log.warning("a replacement rollout worker failed to start: %s", e)
                continue
            log.info("rollout worker %d joined on %s", w.index, w.where)
            self._workers.append(w)
        self._pending = still
        gone = [w for w in self._workers if w.dead]
        self._kill(gone)
        self._workers = [w for w in self._workers if not w.dead]

    async def _recycle_leaky(self) -> None:
        """Workers marked dead during the round (over their memory limit, or died) are
        replaced; the ones that died have their replacement already."""
        recycled = [w for w in self._workers if w.dead and w.recycle]
        for _ in recycled:
            self._replace()
        self._kill(recycled)
        self._workers = [w for w in self._workers if not w.recycle]

    async def _put_failed(
        self, tasks: list[Task], config: RolloutConfig, reason: str, attempts: int,
        result: PlayResult,
    ) -> None:  # fmt: skip
        """The tasks' groups as failed samples: their worker died ``attempts`` times."""
        message = (
            f"rollout worker died {attempts} time(s) playing this task ({reason}); not played again"
        )
        assert self._buffer is not None
        for task in tasks:
            group_id = f"{task.id}@{config.run_id}"
            samples = [
                _failed(group_id, task.id, i, message) for i in range(config.n_samples_per_prompt)
            ]
            await self._buffer.put_group(samples)
            result.groups_put += 1
            result.stats.samples += len(samples)
            result.stats.failed["WorkerDied"] += len(samples)
            result.stats.failed_episodes += len(samples)
            result.stats.status[Status.FAILED.value] += len(samples)
            result.stats.failure_reasons[f"WorkerDied: {message}"[:200]] += len(samples)

    # -- observability ---------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Counts since the run began, each live worker's episodes per busy second, and
        the largest worker process's peak resident set so far."""
        out = {
            "rollout/workers_alive": float(len(self.live())),
            "rollout/worker_restarts": float(self._restarts),
            "rollout/worker_retries": float(self._retries),
            "rollout/worker_failed_parts": float(self._failed_parts),
            "rollout/worker_recycled": float(self._recycled),
            "rollout/workers_in_flight": float(sum(w.in_flight for w in self.live())),
        }
        if self._peak_rss_gib > 0:  # the largest worker process's peak resident set
            out["perf/peak_rss_gib/rollout_workers"] = self._peak_rss_gib
        for w in self.live():
            rate = w.episodes / w.busy_s if w.busy_s > 0 else 0.0
            out[f"rollout/worker_{w.index}_episodes_per_s"] = rate
        return out


def _failed(group_id: str, task_id: str, episode: int, message: str) -> Sample:
    return Sample(
        prompt_ids=[], completion_ids=[], reward=0.0, group_id=group_id,
        id=f"{group_id}/{episode}/0", task_id=task_id, episode=episode, status=Status.FAILED,
        reason=message, error_type="WorkerDied",
    )  # fmt: skip


def _merge(result: PlayResult, part: _Part) -> None:
    s, p = result.stats, part.stats
    s.episodes += p.episodes
    s.samples += p.samples
    s.turns += p.turns
    s.completion_tokens += p.completion_tokens
    s.failed.update(p.failed)
    s.failed_episodes += p.failed_episodes
    s.status.update(p.status)
    s.rewards.extend(p.rewards)
    s.failure_reasons.update(p.failure_reasons)
    s.wall_s = max(s.wall_s, p.wall_s)
    result.groups_put += part.groups_put
    result.roles = max(result.roles, part.roles)


def check_worker_room(
    ray: Any,
    *,
    num_workers: int,
    num_cpus: float,
    resources: Mapping[str, float] | None = None,
    reserved: Mapping[str, float] | None = None,
) -> None:
    """Refuse, before anything is placed or loaded, rollout workers the joined cluster
    can never hold: ``num_workers`` asking ``num_cpus`` CPUs (and ``resources``) each,
    beside the ``reserved`` resources of the run's placement group. (Ray would keep them
    pending until the start timeout, and name its own resource names.)

    Raises:
        ConfigError: naming ``--rollout-num-workers``, ``--rollout-num-cpus-per-worker``
            (or ``--rollout-worker-resource``), the numbers asked and what the cluster
            has, and values that would fit.
    """
    ask = {"CPU": num_cpus, **(resources or {})}
    reserved = reserved or {}
    total: Mapping[str, float] = ray.cluster_resources()
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    cpus = float(total.get("CPU", 0.0))
    room = cpus - float(reserved.get("CPU", 0.0))
    what = (
        f"--rollout-num-workers {num_workers} x --rollout-num-cpus-per-worker {num_cpus:g} "
        f"= {num_workers * num_cpus:g} CPUs"
    )
    placed = f", beside the {reserved['CPU']:g} of the trainer and engine bundles" if (
        reserved.get("CPU")
    ) else ""  # fmt: skip
    has = f"the cluster has {cpus:g} CPUs on {len(nodes)} node(s)"
    for name, amount in ask.items():
        if name != "CPU" and float(total.get(name, 0.0)) < num_workers * amount:
            raise ConfigError(
                f"--rollout-worker-resource {name}: the {num_workers} rollout workers ask "
                f"for {num_workers * amount:g} {name!r} in all, and the cluster has "
                f"{float(total.get(name, 0.0)):g}: start nodes with it (ray start --resources "
                f"'{{\"{name}\": N}}') or lower --rollout-num-workers"
            )
    largest = max((float(n.get("CPU", 0.0)) for n in nodes), default=cpus)
    if num_cpus > largest:
        raise ConfigError(
            f"--rollout-num-cpus-per-worker {num_cpus:g}: no node has that many CPUs "
            f"({has}, at most {largest:g} on one): pass --rollout-num-cpus-per-worker "
            f"{largest:g} or less (a worker mostly waits on the engines)"
        )
    if num_workers * num_cpus > room + 1e-9:
        fixes = []
        if room > 0:
            per = math.floor(room / num_workers * 100) / 100
            if per > 0:
                fixes.append(f"--rollout-num-cpus-per-worker {per:g} (a worker mostly waits "
                             "on the engines)")  # fmt: skip
            fit = math.floor(room / num_cpus + 1e-9)
            if fit >= 1:
                fixes.append(f"--rollout-num-workers {fit}")
        fixes.append("add nodes (ray start --address HEAD)")
        raise ConfigError(
            f"{what} for the rollout workers{placed}, but {has}: pass " + ", or ".join(fixes)
        )


def _actor_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = next((line for line in text if line.strip()), type(e).__name__)
    return f"{type(e).__name__}: {first[:300]}"


def _cluster(asked: Mapping[str, float]) -> str:
    """What the cluster has of the resources a worker asks for (not Ray's own, such as
    ``node:10.0.0.2`` or ``object_store_memory``)."""
    import ray

    total = ray.cluster_resources()  # type: ignore[no-untyped-call]
    free = ray.available_resources()  # type: ignore[no-untyped-call]
    return ", ".join(f"{k} {total.get(k, 0):g} ({free.get(k, 0):g} free)" for k in asked)
