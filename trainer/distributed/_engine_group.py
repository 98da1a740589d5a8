"""The rollout engines of a run as Ray actors behind SGLang's router (docs/distributed.md,
"Rollout engines as Ray actors").

:class:`EngineGroup` starts the engine actors and ``sglang_router.launch_router`` over
them, and is itself the :class:`~agentenv.Generator`: it replaces a dead engine on its slot
(routed again once it holds the run's weights) and retries a generation that failed on
one on the others. Weights reach every engine through :meth:`EngineGroup.weight_sync` or,
from elsewhere, inside :meth:`EngineGroup.updating`; an engine is routed to only while it
holds the group's :attr:`~EngineGroup.weight_version`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc

from agentenv import ClosedResourceError, ConfigError, GenerationError
from trainer.distributed._engine_actor import EngineActor, EngineInfo, EngineSpec
from trainer.engines import OffloadHooks

if TYPE_CHECKING:
    from agentenv import Completion, SamplingParams
    from agentenv.sglang import Launcher, SGLangClient
    from trainer.backends import Backend, WeightSender
    from trainer.engines import WeightSync

__all__ = ["EngineGroup", "EngineGroupError", "EngineHooks", "EngineSlot", "EngineStatistics"]

log = logging.getLogger("trainer.distributed")


class EngineGroupError(GenerationError):
    """The engine group cannot serve: an engine would not start, or more engines died than
    ``max_replacements`` allows."""


@dataclasses.dataclass(frozen=True)
class EngineSlot:
    """Where one engine runs: a bundle of a Ray placement group.

    Args:
        placement_group: a ``ray.util.placement_group.PlacementGroup`` (ready).
        bundle_index: the bundle the engine actor is scheduled on.
        num_gpus: GPUs the actor takes in it (default: the spec's ``gpus_per_engine``;
            a fraction when training shares the GPU, ``--colocate``).
        gpu_ids: the GPUs the server may use (``CUDA_VISIBLE_DEVICES``), as measured by
            the placement; default those Ray assigns the actor.
    """

    placement_group: Any
    bundle_index: int
    num_gpus: float | None = None
    gpu_ids: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class EngineStatistics:
    """What the group has been through (:meth:`EngineGroup.statistics`)."""

    engines: int  #: engines the group runs
    routed: int  #: engines the router sends requests to now
    deaths: int  #: engines found dead
    replacements: int  #: engines started in place of a dead one
    retried_requests: int  #: generations retried after a failure on an engine
    failed_requests: int  #: generations that failed after their retries
    weight_version: str | None  #: the version every routed engine holds (None: initial)


@dataclasses.dataclass(eq=False)
class _Member:
    index: int
    actor: Any
    info: EngineInfo
    client: SGLangClient
    routed: bool = False
    dead: bool = False
    misses: int = 0  # /health failures in a row


class EngineGroup:
    """``num_engines`` engine actors behind SGLang's router; an async context manager.

    ::

        spec = EngineSpec("/ckpt/hf", kind="sglang", gpus_per_engine=2,
                          server_args=("--mem-fraction-static", "0.8"))
        async with EngineGroup(spec, 4, router_args=["--policy", "cache_aware"]) as engines:
            sync = engines.weight_sync("distributed", backend="nccl")
            samples = await runner.run(engines, ...)     # engines is the Generator
            await sync(backend, version=1)               # every engine now at version 1

    Ray must be initialised (``ray.init``) before entering.

    Args:
        spec: what each engine runs.
        num_engines: engines to start (``--rollout-num-gpus`` / ``--rollout-num-gpus-per-engine``).
        slots: one :class:`EngineSlot` per engine (placement-group bundles); default each
            actor asks Ray for ``spec.gpus_per_engine`` GPUs anywhere.
        router_args: flags for the router (the ``--router-*`` flags, prefix stripped).
        router_host: where the router listens (this process reaches it; a free port).
        health_interval: seconds between checks of every engine.
        probe_timeout: seconds an engine has to answer a check.
        failures: failed ``/health`` checks in a row that make an engine dead (a dead actor
            or exited process counts at once).
        max_replacements: engines the group may start in place of dead ones over its life;
            beyond it generation raises :class:`EngineGroupError`.
        request_retries: attempts a failed generation gets on the other engines.
        api_key: the servers' API key (sent to them; give it to the servers in ``spec.env``).
        capacity_per_engine: requests each engine decodes together, as launched
            (:attr:`capacity` is this times the engines; ``None``: not said).

    A :class:`~trainer.RolloutEngine`: :meth:`sync_weights` pushes through the last
    :meth:`weight_sync` made.
    """

    def __init__(
        self,
        spec: EngineSpec,
        num_engines: int,
        *,
        slots: Sequence[EngineSlot] | None = None,
        router_args: Sequence[str] = (),
        router_host: str = "127.0.0.1",
        health_interval: float = 5.0,
        probe_timeout: float = 10.0,
        failures: int = 3,
        max_replacements: int | None = None,
        request_retries: int = 3,
        api_key: str | None = None,
        capacity_per_engine: int | None = None,
    ) -> None:
        if num_engines < 1:
            raise ConfigError(f"num_engines must be at least 1, got {num_engines}")
        if slots is not None and len(slots) != num_engines:
            raise ConfigError(
                f"slots must hold one slot per engine: {num_engines} engines, {len(slots)} "
                "slots given"
            )
        if health_interval <= 0 or probe_timeout <= 0 or failures < 1 or request_retries < 0:
            raise ConfigError(
                "health_interval and probe_timeout must be positive, failures at least 1 and "
                f"request_retries at least 0, got {health_interval}, {probe_timeout}, "
                f"{failures} and {request_retries}"
            )
        self.spec = spec
        self.num_engines = num_engines
        self.slots = list(slots) if slots is not None else None
        self.router_args = list(router_args)
        self.router_host = router_host
        self.health_interval = health_interval
        self.probe_timeout = probe_timeout
        self.failures = failures
        self.max_replacements = num_engines * 4 if max_replacements is None else max_replacements
        self.request_retries = request_retries
        self.api_key = api_key
        self.capacity_per_engine = capacity_per_engine
        #: What :meth:`sync_weights` pushes through (the last :meth:`weight_sync` made).
        self.sync: GroupSync | None = None
        #: The version every routed engine holds; ``None`` until the first sync.
        self.weight_version: str | None = None
        self._members: list[_Member] = []
        self._router: Launcher | None = None
        self._router_client: SGLangClient | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._membership = anyio.Lock()  # held by a weight update and by each admission
        self._checking: anyio.Event | None = None  # set when the check under way ends
        self._replacing: set[int] = set()
        self._catch_up: Callable[[SGLangClient], Awaitable[None]] | None = None
        self._failed: BaseException | None = None
        self._changed = anyio.Event()  # set (and renewed) whenever an engine changes state
        self._closed = False
        self._started = False
        self._deaths = self._replacements = self._retried = self._request_failures = 0
        self._peak_rss_gib = 0.0  # the largest engine process's, as of the last check

    # -- lifecycle -------------------------------------------------------------------------
    async def __aenter__(self) -> EngineGroup:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the engines and the router (what ``async with`` does)."""
        import ray

        from agentenv.sglang import Launcher, SGLangClient, router_command
        from trainer._resources import free_port

        if not ray.is_initialized():
            raise ConfigError(
                "Ray is not initialised: call ray.init(...) (or pass --ray-address) before "
                "starting an EngineGroup"
            )
        if self._started or self._closed:
            raise ConfigError("an EngineGroup starts once")
        self._started = True
        try:
            started: list[_Member | None] = [None] * self.num_engines
            errors: list[Exception] = []

            async def one(i: int, scope: anyio.CancelScope) -> None:
                try:
                    started[i] = await self._launch(i)
                except Exception as e:  # the first failure stops the others' starts
                    errors.append(e)
                    scope.cancel()

            try:
                async with anyio.create_task_group() as tg:
                    for i in range(self.num_engines):
                        tg.start_soon(one, i, tg.cancel_scope)
            finally:  # those that started are stopped with the group if another failed
                self._members = [m for m in started if m is not None]
            if errors:
                raise errors[0]
            port = free_port()
            url = f"http://{self.router_host}:{port}"
            extra = list(self.router_args)
            if not any(a.startswith("--retry-") or a == "--disable-retries" for a in extra):
                # The group retries (and counts) a request that fails on a dead engine, once
                # the engine is out of the router; the router could pick it again.
                extra.append("--disable-retries")
            if not any(a.split("=", 1)[0] == "--prometheus-port" for a in extra):
                # Its default (29000) is one port for every router of the machine.
                extra += ["--prometheus-host", self.router_host]
                extra += ["--prometheus-port", str(free_port())]
            command = router_command(
                [m.info.url for m in self._members], host=self.router_host, port=port, extra=extra
            )
            self._router = Launcher(command, url, health_timeout=120.0)
            await self._router.__aenter__()
            # Retries are the group's (on the other engines), not the client's.
            self._router_client = SGLangClient(url, retries=0, api_key=self.api_key)
            for m in self._members:
                m.routed = True
            await self._wait_routed({m.info.url for m in self._members})
            # Entered after the router's launcher, left before it (task groups nest).
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            self._tg.start_soon(self._watch)
            self._tg.start_soon(self._sample_memory)  # after loading: then every check
        except BaseException:
            # Not under a shield of ours: aclose leaves the task groups entered above.
            await self.aclose()
            raise
        where = ", ".join(f"{m.info.url} (node {m.info.node_ip}, GPUs {m.info.gpu_ids})"
                          for m in self._members)  # fmt: skip
        log.info("%d engines behind the router at %s: %s", len(self._members), url, where)

    async def aclose(self) -> None:
        """Stop the watcher, the router and every engine; later calls raise
        :class:`~agentenv.ClosedResourceError`."""
        if self._closed:
            return
        self._closed = True
        if self._tg is not None:  # left first: it was entered last
            tg, self._tg = self._tg, None
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        if self._router_client is not None:
            await self._router_client.aclose()
        if self._router is not None:  # its task group is left outside any scope of ours
            await self._router.stop()
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for m in self._members:
                    tg.start_soon(self._retire, m)

    @property
    def router_url(self) -> str:
        """The router's URL: any SGLang client (:class:`~agentenv.sglang.SGLangClient`)
        generates through it."""
        if self._router is None:
            raise ConfigError("the EngineGroup is not started")
        return self._router.url

    url = router_url  # the RolloutEngine's: rollout workers generate through the router

    @property
    def capacity(self) -> int | None:
        """Requests the engines decode together: ``capacity_per_engine`` times the
        engines (``None`` when not given)."""
        if self.capacity_per_engine is None:
            return None
        return self.capacity_per_engine * self.num_engines

    @property
    def device(self) -> None:
        """None: the engines run in their actors."""
        return None

    async def sync_weights(self, backend: Backend, version: int) -> None:
        """Every engine at ``backend``'s weights as ``version``, through :attr:`sync`."""
        if self.sync is None:
            raise ConfigError(
                "the EngineGroup has no weight sync: make one with "
                "group.weight_sync('disk' | 'distributed' | 'tensor', ...) first"
            )
        await self.sync(backend, version)

    @property
    def engines(self) -> list[EngineInfo]:
        """Where each engine runs now (index order; a replaced engine's new place)."""
        return [m.info for m in self._members]

    def statistics(self) -> EngineStatistics:
        """What the group has been through, now."""
        return EngineStatistics(
            engines=len(self._members),
            routed=sum(m.routed for m in self._members),
            deaths=self._deaths,
            replacements=self._replacements,
            retried_requests=self._retried,
            failed_requests=self._request_failures,
            weight_version=self.weight_version,
        )

    def metrics(self) -> dict[str, float]:
        """The statistics as the run's step metrics (``rollout/engine_...``), and the
        largest engine process's peak resident set as of the last check
        (``perf/peak_rss_gib/engines``, once measured)."""
        s = self.statistics()
        return {
            "rollout/engine_routed": float(s.routed),
            "rollout/engine_deaths": float(s.deaths),
            "rollout/engine_replacements": float(s.replacements),
            "rollout/engine_retried_requests": float(s.retried_requests),
            "rollout/engine_failed_requests": float(s.failed_requests),
            **({"perf/peak_rss_gib/engines": self._peak_rss_gib} if self._peak_rss_gib else {}),
        }

    async def wait_ready(self, timeout: float = 600.0) -> None:  # noqa: ASYNC109
        """Until every engine is routed to and no replacement is under way (after a death,
        a replacement that waits for the next weight sync never gets ready before it);
        raises :class:`EngineGroupError` if the group has failed, ``TimeoutError`` after
        ``timeout`` s."""
        with anyio.fail_after(timeout):
            while True:
                if self._failed is not None:
                    raise EngineGroupError(str(self._failed)) from self._failed
                changed = self._changed
                if not self._replacing and all(m.routed for m in self._members):
                    return
                await changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # -- generation ------------------------------------------------------------------------
    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        """Generate through the router; a failure on an engine (5xx, lost connection) is
        retried on the others after the dead engine is taken out of the router."""
        from agentenv.sglang import SGLangError

        client = self._client()
        for attempt in range(self.request_retries + 1):
            if self._failed is not None:
                raise EngineGroupError(str(self._failed)) from self._failed
            try:
                return await client.generate(input_ids, params, rid=rid)
            except SGLangError as e:
                if e.status is not None and e.status < 500:
                    raise
                if attempt == self.request_retries:
                    self._request_failures += 1
                    log.error(
                        "request %s failed %d times on the engines; giving up: %s",
                        rid, attempt + 1, e,
                    )  # fmt: skip
                    raise
                self._retried += 1
                log.warning(
                    "request %s failed on an engine (%s); retrying on the others (%d of %d)",
                    rid, e, attempt + 1, self.request_retries,
                )  # fmt: skip
                await self.check()
        raise AssertionError("unreachable")  # pragma: no cover

    async def abort_all(self) -> None:
        """Abort every request on every engine (the router does not forward aborts)."""
        async with anyio.create_task_group() as tg:
            for m in self._live():
                tg.start_soon(_quietly, m.client.abort_all)

    def _client(self) -> SGLangClient:
        if self._closed:
            raise ClosedResourceError("the EngineGroup is closed")
        if self._router_client is None:
            raise ConfigError("use the EngineGroup inside `async with EngineGroup(...)`")
        return self._router_client

    def _live(self) -> list[_Member]:
        return [m for m in self._members if not m.dead]

    # -- colocated training ----------------------------------------------------------------
    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Every engine gives its memory back while training runs (``--colocate``). An
        engine that cannot be reached (it died since the last check) is checked and
        replaced; its replacement starts with its memory held."""
        await self._on_each("release_memory_occupation", tags)

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Every engine takes its memory back after training (one that cannot be reached:
        as :meth:`release_memory`)."""
        await self._on_each("resume_memory_occupation", tags)

    async def _on_each(self, method: str, tags: Sequence[str] | None) -> None:
        from agentenv.sglang import SGLangError

        failed: list[str] = []

        async def one(m: _Member) -> None:
            try:
                await getattr(m.client, method)(tags)
            except Exception as e:
                refused = isinstance(e, SGLangError) and e.status is not None and e.status < 500
                if not m.dead and (refused or not isinstance(e, SGLangError)):
                    raise  # refused (e.g. requests still running): the caller's mistake
                # Unreachable, or found dead (its client closed) while the call ran.
                failed.append(f"engine {m.index} at {m.info.url}: {e}")

        async with anyio.create_task_group() as tg:
            for m in self._live():
                tg.start_soon(one, m)
        if failed:
            log.warning("%s failed on %s; checking the engines", method, "; ".join(failed))
            await self.check()

    # -- weights ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def updating(self, version: int | str) -> AsyncIterator[list[SGLangClient]]:
        """Hold the engines steady while new weights go to them: yields a client per live
        engine (routed, or replaced and waiting for these weights); push ``version`` to
        all of them inside. When the block ends without an error every engine holds
        ``version``, and the ones that waited for it are routed to. No engine is replaced
        meanwhile (a dead one is replaced after the block)."""
        async with self._membership:
            members = self._live()
            yield [m.client for m in members]
            self.weight_version = str(version)
            self._catch_up = None  # the sync may say how to catch up (disk): after this
            for m in members:
                if not m.routed and not m.dead:
                    await self._route(m)

    def bundle_of(self, client: SGLangClient) -> int | None:
        """The placement bundle of the engine ``client`` talks to (None: not placed)."""
        for m in self._members:
            if m.client is client and self.slots is not None:
                return self.slots[m.index].bundle_index
        return None

    def weight_sync(
        self,
        kind: Literal["disk", "distributed", "tensor"],
        *,
        directory: str | Path | None = None,
        backend: Literal["nccl", "gloo"] = "nccl",
        master_address: str = "127.0.0.1",
        bucket_bytes: int = 512 << 20,
        timeout: float = 120.0,
        retries: int = 1,
    ) -> GroupSync:
        """A :class:`~trainer.WeightSync` (``await sync(backend, version)``) into every
        engine: ``disk`` saves under ``directory`` (shared by every node) and has each
        engine load it; ``distributed`` broadcasts from the backend's weight sender
        (trainer rank 0's actor on Ray) over ``backend``; ``tensor`` hands each engine the
        weights by handle from the trainer rank on its GPU (``--colocate``). A sync that
        fails because an engine died is retried ``retries`` times once the engine is
        replaced; a replaced engine gets the last weights from disk at once, or, otherwise,
        with the next sync. It becomes the group's :attr:`sync`."""
        self.sync = GroupSync(
            self, kind, directory=directory, backend=backend, master_address=master_address,
            bucket_bytes=bucket_bytes, timeout=timeout, retries=retries,
        )  # fmt: skip
        return self.sync

    # -- watching and replacing ------------------------------------------------------------
    async def check(self) -> None:
        """Check every engine now (or wait for the check under way) and replace the dead."""
        if self._closed:
            return
        if self._checking is not None:
            await self._checking.wait()
            return
        self._checking = done = anyio.Event()
        try:
            dead: list[tuple[_Member, str]] = []

            async def probe(m: _Member) -> None:
                try:
                    reason = await self._probe(m)
                except Exception as e:  # Ray could not tell: a miss, not a death
                    log.warning("checking engine %d failed: %s", m.index, e)
                    m.misses += 1
                    reason = None
                if reason is not None:
                    dead.append((m, reason))

            async with anyio.create_task_group() as tg:
                for m in self._live():
                    tg.start_soon(probe, m)
            for m, reason in dead:
                await self._bury(m, reason)
        finally:
            self._checking = None
            done.set()
        if self._tg is None:  # closed meanwhile
            return
        for m, _ in dead:
            if m.index not in self._replacing:
                self._replacing.add(m.index)
                self._notify()
                self._tg.start_soon(self._replace, m)

    async def _watch(self) -> None:
        while True:
            await anyio.sleep(self.health_interval)
            try:
                await self.check()
            except Exception:  # the watcher goes on: a failed check is tried again
                log.exception("checking the engines failed")
            await self._sample_memory()

    async def _sample_memory(self) -> None:
        """Keep the largest peak resident set so far of the live engines' processes
        (each actor and its server's: :meth:`EngineActor.peak_rss_gib`)."""

        async def sample(m: _Member) -> None:
            with anyio.move_on_after(self.probe_timeout):
                try:
                    gib = float(await m.actor.peak_rss_gib.remote())
                except Exception:  # a dead or busy actor: the health check decides
                    return
                self._peak_rss_gib = max(self._peak_rss_gib, gib)

        async with anyio.create_task_group() as tg:
            for m in self._live():
                tg.start_soon(sample, m)

    async def _probe(self, m: _Member) -> str | None:
        """``None`` if the engine is well, else why it is dead."""
        from ray.exceptions import RayActorError

        try:
            with anyio.fail_after(self.probe_timeout):
                reason: str | None = await m.actor.alive.remote()
        except RayActorError as e:
            return f"its actor died ({type(e).__name__})"
        except TimeoutError:
            reason = None  # a busy actor is not a dead one: the health check decides
            m.misses += 1
        if reason is not None:
            return reason
        if not await _listening(m.info.url):
            return "its server refuses connections"
        healthy = False
        with anyio.move_on_after(self.probe_timeout):  # a hanging server is a miss
            healthy = await m.client.health()
        if healthy:
            m.misses = 0
            return None
        m.misses += 1
        if m.misses >= self.failures:
            return f"/health failed {m.misses} times running"
        return None

    async def _bury(self, m: _Member, reason: str) -> None:
        m.dead = True
        self._deaths += 1
        self._notify()
        log.warning(
            "engine %d at %s (node %s) is dead: %s; taking it out of the router and replacing it",
            m.index, m.info.url, m.info.node_ip, reason,
        )  # fmt: skip
        if m.routed and self._router_client is not None:
            m.routed = False
            with anyio.move_on_after(self.probe_timeout):
                await _quietly(self._unroute, m.info.url)

    async def _replace(self, dead: _Member) -> None:
        start = time.perf_counter()
        try:
            if self._replacements >= self.max_replacements:
                raise EngineGroupError(
                    f"engine {dead.index} died and the group has replaced {self._replacements} "
                    f"engines already (max_replacements={self.max_replacements}); the last "
                    f"death: {dead.info.url} on node {dead.info.node_ip}"
                )
            await self._retire(dead)
            fresh = await self._launch(dead.index)
            self._replacements += 1
            async with self._membership:
                self._members[self._members.index(dead)] = fresh
                # Routed only at the group's version: the checkpoint's before any sync, else
                # the last synced weights if they can be had again (disk).
                if self.weight_version is None or self._catch_up is not None:
                    if self._catch_up is not None:
                        await self._catch_up(fresh.client)
                    await self._route(fresh)
            log.warning(
                "engine %d replaced by %s (node %s) in %.1f s%s",
                fresh.index, fresh.info.url, fresh.info.node_ip, time.perf_counter() - start,
                "" if fresh.routed else "; routed to after the next weight sync",
            )  # fmt: skip
        except Exception as e:
            log.error("engine %d could not be replaced: %s", dead.index, e)
            self._failed = e
        finally:
            self._replacing.discard(dead.index)
            self._notify()

    async def _launch(self, index: int) -> _Member:
        import ray

        from agentenv.sglang import SGLangClient

        spec = self.spec
        options: dict[str, Any] = {
            "num_cpus": spec.cpus_per_engine,
            "num_gpus": spec.gpus_per_engine,
            "max_restarts": 0,
            "max_concurrency": 64,
        }
        gpu_ids = None
        if self.slots is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            slot = self.slots[index]
            if slot.num_gpus is not None:
                options["num_gpus"] = slot.num_gpus
            gpu_ids = slot.gpu_ids
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                slot.placement_group, placement_group_bundle_index=slot.bundle_index
            )
        remote: Any = ray.remote(EngineActor)
        actor: Any = remote.options(**options).remote()
        try:
            info: EngineInfo = await actor.start.remote(spec, gpu_ids)
        except BaseException as e:
            ray.kill(actor, no_restart=True)
            if isinstance(e, Exception):
                cause = getattr(e, "cause", None) or e  # a RayTaskError carries the actor's
                raise EngineGroupError(f"engine {index} did not start: {cause}") from e
            raise
        client = SGLangClient(info.url, api_key=self.api_key)
        return _Member(index, actor, info, client)

    async def _retire(self, m: _Member) -> None:
        import ray

        with anyio.move_on_after(self.probe_timeout):
            await _quietly(lambda: m.actor.stop.remote())
        with contextlib.suppress(Exception):
            ray.kill(m.actor, no_restart=True)
        await m.client.aclose()

    async def _unroute(self, url: str) -> None:
        client = self._client()
        await client.remove_worker(url)
        while True:  # the router removes it in the background
            if url not in await client.list_workers():
                return
            await anyio.sleep(0.05)

    async def _route(self, m: _Member) -> None:
        client = self._client()
        await client.add_worker(m.info.url)
        await self._wait_routed({m.info.url})
        m.routed = True
        self._notify()

    async def _wait_routed(self, urls: set[str]) -> None:
        """Until the router lists ``urls`` (it adds workers in the background)."""
        client = self._client()
        with anyio.fail_after(60.0):
            while True:
                if urls <= set(await client.list_workers()):
                    return
                await anyio.sleep(0.1)


class GroupSync:
    """A :class:`~trainer.WeightSync` into every engine of an :class:`EngineGroup` (see
    :meth:`EngineGroup.weight_sync`)."""

    def __init__(
        self,
        group: EngineGroup,
        kind: Literal["disk", "distributed", "tensor"],
        *,
        directory: str | Path | None,
        backend: Literal["nccl", "gloo"],
        master_address: str,
        bucket_bytes: int,
        timeout: float,
        retries: int,
    ) -> None:
        if kind not in ("disk", "distributed", "tensor"):
            raise ConfigError(f"kind must be disk, distributed or tensor, got {kind!r}")
        if kind == "disk" and directory is None:
            raise ConfigError("a disk weight sync needs a directory that every node sees")
        if retries < 0:
            raise ConfigError(f"retries must be at least 0, got {retries}")
        self.group = group
        self.kind = kind
        self.directory = None if directory is None else Path(directory)
        self.backend = backend
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.retries = retries
        self._inner: Any = None
        self._targets: list[SGLangClient] = []

    async def __call__(self, backend: Backend, version: int) -> None:
        start = time.perf_counter()
        for attempt in range(self.retries + 1):
            try:
                async with self.group.updating(version) as clients:
                    sync = await self._sync_for(clients)
                    await sync(backend, version)
                break
            except Exception as e:
                if attempt == self.retries:
                    raise
                log.warning(
                    "weight sync to version %s failed (%s); checking the engines and retrying",
                    version, e,
                )  # fmt: skip
                await self._drop()
                await self.group.check()
                await self._wait_replaced()
        if self.kind == "disk":
            assert self.directory is not None
            path = str((self.directory / f"step_{version}").resolve())

            async def catch_up(client: SGLangClient) -> None:
                await client.update_weights_from_disk(path, weight_version=str(version))

            self.group._catch_up = catch_up
        log.info(
            "weights at version %s in %d engines (%s) in %.2f s",
            version, len(self._targets or self.group.engines), self.kind,
            time.perf_counter() - start,
        )  # fmt: skip

    async def _sync_for(self, clients: list[SGLangClient]) -> WeightSync:
        from trainer.engines import DiskSync, DistributedSync, TensorSync

        if self.kind == "tensor":
            return TensorSync(clients, api_key=self.group.api_key, senders=self._colocated)

        if self.kind == "disk":
            assert self.directory is not None
            if self._inner is None:
                self._inner = DiskSync(clients, self.directory)
            self._inner.clients = list(clients)  # the same directory: old steps are removed
            return self._inner  # type: ignore[no-any-return]
        if self._inner is not None and self._targets != clients:
            await self._drop()  # a new engine: a new process group
        if self._inner is None:
            self._inner = DistributedSync(
                clients, backend=self.backend, master_address=self.master_address,
                bucket_bytes=self.bucket_bytes, timeout=self.timeout,
            )  # fmt: skip
            self._targets = list(clients)
        return self._inner  # type: ignore[no-any-return]

    def _colocated(
        self, backend: Backend, clients: Sequence[SGLangClient]
    ) -> list[tuple[WeightSender, list[SGLangClient]]]:
        """Each engine's weights from the trainer rank in its (first) bundle."""
        rank_on = getattr(backend, "rank_on", None)
        if rank_on is None:
            raise ConfigError(
                f"a tensor weight sync hands the weights over from the trainer rank on each "
                f"engine's GPU, but {type(backend).__name__} has no ranks on the placement "
                "(the torch backend's ranks on Ray have); use --weight-sync disk"
            )
        plan: dict[int, list[SGLangClient]] = {}
        for client in clients:
            bundle = self.group.bundle_of(client)
            rank = None if bundle is None else rank_on(bundle)
            if rank is None:
                raise ConfigError(
                    f"the engine at {client.url} shares no GPU with a trainer rank (bundle "
                    f"{bundle}): a tensor weight sync needs --colocate with no more engine "
                    "GPUs than trainer GPUs; use --weight-sync disk"
                )
            plan.setdefault(rank, []).append(client)
        sender_of: Any = backend.weight_sender  # the ranks': one per rank
        return [(sender_of(rank), mine) for rank, mine in sorted(plan.items())]

    async def _drop(self) -> None:
        if self.kind == "distributed" and self._inner is not None:
            inner, self._inner = self._inner, None
            with anyio.move_on_after(self.timeout):
                await inner.aclose()

    async def _wait_replaced(self) -> None:
        """Until no replacement is under way (bounded by the engines' start timeout)."""
        group = self.group
        with anyio.move_on_after(group.spec.health_timeout + 60.0):
            while group._replacing and group._failed is None:
                await group._changed.wait()

    async def aclose(self) -> None:
        """Leave the distributed group (if one was formed)."""
        await self._drop()


class EngineHooks(OffloadHooks):
    """The loop's :class:`~trainer.StepHooks` for an :class:`EngineGroup`: with
    ``colocated`` (``--colocate``: the engines share the trainer's GPUs) every engine
    releases its memory before a step's training and resumes it after, before the weight
    sync (:class:`~trainer.OffloadHooks`, whose metrics join the step's); and each step's
    metrics get the group's statistics as ``rollout/engine_*`` (``routed``, ``deaths``,
    ``replacements``, ``retried_requests``, ``failed_requests``: counts since the run
    began)."""

    def __init__(self, group: EngineGroup, *, colocated: bool = False) -> None:
        super().__init__(group)
        self.group = group
        self.colocated = colocated

    async def before_train(self, step: int) -> None:
        if self.colocated:
            await super().before_train(step)

    async def after_train(self, step: int) -> None:
        if self.colocated:
            await super().after_train(step)

    def metrics(self) -> dict[str, float]:
        return {**self.group.metrics(), **(super().metrics() if self.colocated else {})}


async def _listening(url: str) -> bool:
    """Whether something accepts connections at ``url`` (a refusal: nothing listens)."""
    import httpx

    parsed = httpx.URL(url)
    try:
        with anyio.fail_after(5.0):
            stream = await anyio.connect_tcp(parsed.host, parsed.port or 80)
    except OSError:
        return False
    except TimeoutError:
        return True  # slow is not dead: /health decides
    await stream.aclose()
    return True


async def _quietly(call: Callable[..., Awaitable[object]], *args: Any) -> None:
    with contextlib.suppress(Exception):
        await call(*args)
