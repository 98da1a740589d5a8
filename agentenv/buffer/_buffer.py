"""The Data Buffer: finished groups in, batches for the trainer out (docs/buffer.md).

A batch counts as consumed only when the trainer acknowledges its step; with ``path=``,
everything that matters is on disk before the call that changed it returns.

    async with Buffer(BufferConfig(n_samples_per_prompt=8, rollout_batch_size=32),
                      path="runs/exp1/buffer") as buffer:
        stats = await run_rollouts(env, tasks, policy, tokenizer=tok, sink=buffer)
        batch = await buffer.get_batch(policy_version=step)
        ...train on batch.samples...
        await buffer.ack(batch, step=step)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import json
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio

from agentenv._errors import AgentEnvError, ClosedResourceError, ConfigError, SampleError
from agentenv._sample import Sample, Status
from agentenv.buffer._codec import encode_sample
from agentenv.buffer._config import BufferConfig, FilterResult
from agentenv.buffer._store import Consumed, GroupRecord, MemoryStore, SqliteStore, Store

__all__ = ["Batch", "Buffer", "BufferStats", "Group", "LeaseExpiredError", "UnknownBatchError"]

# A put or acknowledgement waiting for the group commit: records to store, batches
# consumed, and the slot its result (flags per record, or an exception) goes into.
_Entry = tuple[list[GroupRecord], list[Consumed], list[Any]]

T = TypeVar("T")

# Expired batches remembered, so that a late ack or renewal can still take its groups back
# while nobody else has them (the oldest are forgotten first).
_EXPIRED_KEPT = 4096
_INT64 = 2**63


class UnknownBatchError(AgentEnvError, KeyError):
    """``ack`` or ``release`` named a batch this Buffer did not hand out (or already settled)."""


class LeaseExpiredError(UnknownBatchError):
    """The batch's lease ran out and its groups went to another consumer (or were dropped):
    the step that trained on it must not be committed."""


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    """The samples of one task's episodes for one role, in episode order."""

    group_id: str
    role: str | None
    task_id: str | None
    samples: tuple[Sample, ...]
    version: int | None
    seq: int
    # The samples already encoded (from the wire or the store), aligned with ``samples``;
    # the service sends these instead of encoding again.
    encoded: tuple[bytes, ...] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """Groups handed to one trainer step; ``ack`` it when the step is committed."""

    id: str
    groups: tuple[Group, ...]
    policy_version: int | None
    # Seconds the batch stays handed out without a renewal; None: until ack or release.
    lease_s: float | None = None

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


@dataclasses.dataclass(slots=True)
class BufferStats:
    """Counters of everything the Buffer decided."""

    groups_put: int = 0
    samples_put: int = 0
    duplicate_groups: int = 0
    kept: int = 0
    dropped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    failed_samples_dropped: int = 0
    stale_dropped: int = 0
    recycled: int = 0
    ready: int = 0
    handed: int = 0
    consumed: int = 0
    batches: int = 0
    in_flight: int = 0
    leases_expired: int = 0
    policy_version: int | None = None
    # Seconds spent in the store: encoding and writing samples, committing and (durable)
    # syncing them, acknowledgements, notes -- what durability costs, beside the in-memory
    # store's dict operations. Commits run in a worker thread while the loop goes on.
    store_s: float = 0.0

    @property
    def pass_rate(self) -> float:
        """Fraction of complete groups kept (1.0 before any decision)."""
        total = self.kept + sum(self.dropped.values())
        return self.kept / total if total else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["dropped"] = dict(self.dropped)
        d["pass_rate"] = self.pass_rate
        return d


def _check_count(method: str, prompts: object) -> None:
    if type(prompts) is not int or prompts < 0:
        raise ConfigError(
            f"{method} takes a number of prompts >= 0, got {prompts!r}: count the rollouts "
            f"that {'will start' if method == 'reserve' else 'will not be put'}"
        )


def _check_step(step: object) -> None:
    if step is not None and (type(step) is not int or not -_INT64 <= step < _INT64):
        raise ConfigError(f"a step must be an int (a 64-bit one), got {step!r}")


def _versions(samples: Sequence[Sample]) -> int | None:
    # The oldest policy version that produced any token of the group.
    oldest: int | None = None
    for s in samples:
        for v in s.weight_versions:
            try:
                n = int(v)
            except ValueError:
                raise SampleError(
                    f"sample {s.id!r} has weight version {v!r}; staleness needs integer "
                    "versions (the trainer's step numbers)"
                ) from None
            oldest = n if oldest is None else min(oldest, n)
    return oldest


class Buffer:
    """Groups in, batches out; in memory, or durable with ``path=DIR``.

    Use as an async context manager (or call :meth:`aclose`). Implements the runner's
    ``SampleSink`` (``put_group``), so ``run_rollouts(..., sink=buffer)`` fills it.
    """

    def __init__(
        self,
        config: BufferConfig | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.config = config or BufferConfig()
        self.path = path
        self._store: Store = (
            SqliteStore(path, durability=self.config.durability)
            if path is not None
            else MemoryStore()
        )
        self._durable = path is not None
        self._ready: collections.deque[Group] = collections.deque()
        self._handed: dict[str, Batch] = {}
        self._leases: dict[str, float] = {}  # leased batch id -> monotonic deadline
        self._expired: collections.OrderedDict[str, Batch] = collections.OrderedDict()
        self._filling = 0  # puts admitted past the capacity check, not yet ready or dropped
        self._recycled: list[str] = []
        self._stats = BufferStats()
        self._changed = anyio.Event()
        self._lock = anyio.Lock()  # one store call at a time: SQLite is used from one thread
        self._pending: list[_Entry] = []
        self._committing = False
        self._closed = False
        try:
            for record in self._store.ready():
                self._ready.append(self._group(record))
        except BaseException:
            self._store.close()  # and its directory's lock with it
            raise

    # -- lifecycle -----------------------------------------------------------------------
    async def __aenter__(self) -> Buffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the store; later calls raise :class:`ClosedResourceError`."""
        if not self._closed:
            self._closed = True
            async with self._lock:
                self._store.close()
            self._notify()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("the Buffer is closed")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # -- producing -----------------------------------------------------------------------
    async def put_group(self, samples: Sequence[Sample]) -> None:
        """Add one finished group (every episode of one task, failed ones included).

        Returns once the group is stored (on disk, for a durable Buffer). Waits while the
        Buffer holds ``capacity`` ready groups. A group whose sample ids are all stored
        already is a no-op (counted in ``duplicate_groups``). Cancelled while it waits for
        room (or in a filter), the put is withdrawn; once its samples are being stored it
        completes first, so a put is applied wholly or not at all.
        """
        await self._put_encoded(samples, None)

    async def _put_encoded(
        self, samples: Sequence[Sample], encoded: Sequence[bytes] | None
    ) -> None:
        """:meth:`put_group`, given the samples' encodings too (a transport that received
        them encoded): they are stored and sent on as they are instead of encoded again."""
        self._check_open()
        records = self._assemble(samples)
        if encoded is not None:
            # By object identity: _assemble keeps the objects (or replaces one whose id it
            # fills in, whose old encoding no longer matches).
            known = {id(s): blob for s, blob in zip(samples, encoded, strict=True)}
            for record in records:
                record.blobs = [known.get(id(s)) or encode_sample(s) for s in record.samples]
        # The room is taken here, before the filters and the commit wait: checking only
        # the ready groups would let every put that is waiting for them pass at once.
        while len(self._ready) + self._filling >= self.config.capacity:
            changed = self._changed
            await changed.wait()
            self._check_open()
        self._filling += 1
        try:
            await self._put_admitted(records, len(samples))
        finally:
            self._filling -= 1
            self._notify()

    async def _put_admitted(self, records: list[GroupRecord], n_samples: int) -> None:
        for record in records:
            if record.state == "ready":
                verdict = await self._filter(record.samples)
                if not verdict.keep:
                    record.state, record.reason = "dropped", verdict.reason or "filtered"
        # From here on the put completes (or fails) as a whole: once its samples are being
        # written, cancelling the caller must not leave them stored but not ready.
        with anyio.CancelScope(shield=True):
            new = await self._commit(records, [])
            if not any(new):  # a group re-put (a retried round): its reservation went already
                self._stats.duplicate_groups += 1
                return
            self._stats.in_flight = max(0, self._stats.in_flight - 1)
            self._stats.groups_put += 1
            self._stats.samples_put += n_samples
            for record, is_new in zip(records, new, strict=True):
                if not is_new:
                    continue
                if record.state == "ready":
                    self._stats.kept += 1
                    self._ready.append(self._group(record))
                else:
                    self._stats.dropped[record.reason] += 1

    def _assemble(self, samples: Sequence[Sample]) -> list[GroupRecord]:
        if not samples:
            raise SampleError("put_group needs at least one sample")
        first = samples[0]
        group_id = first.group_id if isinstance(first, Sample) else None
        # One pass over the group: it runs for every put, so it stays cheap.
        ids: list[str] = []
        episodes: set[int] = set()
        has_roles = has_failed = missing_ids = False
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise SampleError(f"put_group takes Sample objects, item {i} is {type(s).__name__}")
            if s.group_id is None:
                raise SampleError(f"sample {i} has no group_id; the Buffer groups by it")
            if s.group_id != group_id:
                raise SampleError(
                    f"one put_group call takes one group, got group ids {group_id!r} and "
                    f"{s.group_id!r}"
                )
            if s.id is None:
                missing_ids = True
                ids.append(f"{group_id}/{i}")
            else:
                ids.append(s.id)
            episodes.add(s.episode if s.episode is not None else -1 - i)
            has_roles = has_roles or s.role is not None
            has_failed = has_failed or s.status is Status.FAILED
        assert group_id is not None
        if len(set(ids)) != len(ids):
            raise SampleError(f"group {group_id!r} repeats a sample id")
        n = self.config.n_samples_per_prompt
        if len(episodes) > n:
            raise SampleError(
                f"group {group_id!r} has {len(episodes)} episodes but n_samples_per_prompt "
                f"is {n}; a group holds at most n_samples_per_prompt episodes"
            )
        members = list(samples)
        if missing_ids:
            members = [
                s if s.id is not None else dataclasses.replace(s, id=ids[i])
                for i, s in enumerate(members)
            ]
        if not has_roles:
            return [self._decide(group_id, None, members, len(episodes) if not has_failed else 0)]
        # Multi-agent episodes: one group per (task, role). A sample without a role (a
        # failed episode's) is stored once, with the first role.
        roles = sorted({s.role for s in members if s.role is not None})
        return [
            self._decide(
                group_id,
                role,
                [s for s in members if s.role == role or (k == 0 and s.role is None)],
                0,
            )
            for k, role in enumerate(roles)
        ]

    def _decide(
        self, group_id: str, role: str | None, samples: list[Sample], episodes_known: int
    ) -> GroupRecord:
        """Apply the failed-sample policy, the group-size floor and staleness on arrival.

        ``episodes_known``: the number of episodes when the caller counted them and no
        sample failed (0: count here).
        """
        task_id = samples[0].task_id
        record = GroupRecord(group_id, role, task_id, samples, "ready")
        alive = samples
        if episodes_known:
            episodes = episodes_known
        else:
            failed = [s for s in samples if s.status is Status.FAILED]
            alive = [s for s in samples if s.status is not Status.FAILED]
            if failed:
                if self.config.on_failed == "drop_group":
                    record.state, record.reason = "dropped", "failed_sample"
                    return record
                self._stats.failed_samples_dropped += len(failed)
                # Failed samples are stored for inspection, never handed to the trainer.
                record.samples = [*alive, *failed]
            episodes = len({s.episode if s.episode is not None else id(s) for s in alive})
        if task_id is None:
            task_id = record.task_id = next((s.task_id for s in samples if s.task_id), None)
        if episodes < self.config.min_group_size:
            record.state, record.reason = "dropped", "too_small"
        elif self.config.max_staleness is not None:
            record.version = _versions(alive)
            if self._is_stale(record.version):
                record.state, record.reason = self._stale_state(task_id)
        return record

    async def _filter(self, samples: Sequence[Sample]) -> FilterResult:
        alive = [s for s in samples if s.status is not Status.FAILED]
        for f in self.config.filters:
            verdict = f(alive)
            if inspect.isawaitable(verdict):
                verdict = await verdict
            if isinstance(verdict, FilterResult):
                if not verdict.keep:
                    return verdict
            elif not verdict:
                return FilterResult(False, getattr(f, "__name__", type(f).__name__))
        return FilterResult(True)

    async def _commit(self, records: list[GroupRecord], consumed: list[Consumed]) -> list[bool]:
        """Store ``records`` and mark ``consumed`` groups, durably; per record, whether it
        was new."""
        if not self._durable:  # nothing to wait for: a few dict operations
            return self._store.commit(records, consumed)
        # Encoding and writing the sample bodies to the log happen here, on the event
        # loop's thread, at once -- also while an earlier commit waits for the disk. The
        # store's thread then only indexes and syncs (SQLite and fsync release the GIL).
        self._check_open()
        start = time.perf_counter()
        self._store.stage(records)
        self._stats.store_s += time.perf_counter() - start
        # Group commit: whoever finds no commit running becomes the committer and writes
        # every pending put and acknowledgement in one transaction (one fsync); the others
        # wait for its result.
        slot: list[Any] = []
        self._pending.append((list(records), consumed, slot))
        if self._committing:
            while not slot:
                changed = self._changed
                await changed.wait()
        else:
            self._committing = True
            try:
                # Shielded: the commit serves every waiting put, so cancelling the task
                # that happens to run it must neither abandon nor fail the others.
                with anyio.CancelScope(shield=True):
                    await self._commit_pending()
            finally:
                self._committing = False
        result = slot[0]
        if isinstance(result, BaseException):
            raise result
        return list(result)

    async def _commit_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await self._commit_batch(batch)
            except ConfigError:
                # A caller's mistake in one put (sample ids stored under another group)
                # fails the transaction: commit the entries one by one, so only it fails.
                for entry in batch:
                    with contextlib.suppress(Exception):
                        await self._commit_batch([entry])
            self._notify()

    async def _commit_batch(self, batch: list[_Entry]) -> None:
        """One transaction for ``batch``; each entry's slot gets its flags or the error
        (re-raised for a multi-entry batch's ConfigError, which the caller splits)."""
        flat = [r for recs, _, _ in batch for r in recs]
        consumed = [c for _, cs, _ in batch for c in cs]
        try:
            async with self._lock:
                self._check_open()
                start = time.perf_counter()
                try:
                    if self._store.blocks:
                        flags = await anyio.to_thread.run_sync(self._store.commit, flat, consumed)
                    else:
                        flags = self._store.commit(flat, consumed)
                finally:
                    self._stats.store_s += time.perf_counter() - start
        except Exception as e:
            if isinstance(e, ConfigError) and len(batch) > 1:
                raise
            for _, _, out in batch:
                out.append(e)
            return
        i = 0
        for recs, _, out in batch:
            out.append(flags[i : i + len(recs)])
            i += len(recs)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        # The in-memory store is a few dict operations: a thread hop would cost more.
        start = time.perf_counter()
        try:
            if self._durable:
                return await anyio.to_thread.run_sync(fn, *args)
            return fn(*args)
        finally:
            self._stats.store_s += time.perf_counter() - start

    def _group(self, record: GroupRecord) -> Group:
        alive = [k for k, s in enumerate(record.samples) if s.status is not Status.FAILED]
        blobs = record.blobs
        return Group(
            group_id=record.group_id,
            role=record.role,
            task_id=record.task_id,
            samples=tuple(record.samples[k] for k in alive),
            version=record.version,
            seq=record.seq,
            encoded=None if blobs is None else tuple(blobs[k] for k in alive),
        )

    # -- staleness and admission ---------------------------------------------------------
    def _is_stale(self, version: int | None) -> bool:
        limit = self.config.max_staleness
        current = self._stats.policy_version
        return (
            limit is not None
            and current is not None
            and version is not None
            and (current - version > limit)
        )

    def _stale_state(self, task_id: str | None) -> tuple[str, str]:
        if self.config.on_stale == "recycle" and task_id is not None:
            self._recycled.append(task_id)
            self._stats.recycled += 1
            return "stale", "recycled"
        self._stats.stale_dropped += 1
        return "stale", "stale"

    async def set_policy_version(self, version: int) -> None:
        """The trainer's current policy version (its step); staleness is measured from it."""
        self._stats.policy_version = version
        self._notify()

    async def recycled(self) -> list[str]:
        """Task ids whose groups went stale (``on_stale="recycle"``); taken once."""
        out, self._recycled = self._recycled, []
        return out

    async def prompts_to_start(self, groups: int | None = None) -> int:
        """How many more prompts to start so that ``groups`` kept groups will be ready.

        Uses the observed filter pass rate and the prompts already started
        (:meth:`reserve`), so producers over-sample just enough; surplus kept groups stay
        for the next batch.
        """
        target = groups or self.config.rollout_batch_size or 1
        rate = max(self._stats.pass_rate, 0.05)
        expected = len(self._ready) + self._stats.in_flight * rate
        missing = target - expected
        return max(0, math.ceil(missing / rate)) if missing > 0 else 0

    async def reserve(self, prompts: int = 1) -> None:
        """Admission control: wait until ``prompts`` more rollouts may start.

        With ``max_staleness`` and ``rollout_batch_size`` set, the prompts alive (in flight
        or ready) are bounded by ``(max_staleness + 1) * rollout_batch_size``, so a group
        started now is at most ``max_staleness`` versions old when taken unless a later one
        overtakes it; while fewer than a batch are alive a reservation always passes
        (docs/buffer.md says why). Without those settings it only counts the prompts in
        flight. One reservation takes at most ``capacity`` prompts (or that bound when
        larger); more is a :class:`ConfigError`.
        """
        self._check_open()
        _check_count("reserve", prompts)
        limit = self.config.max_staleness
        per_step = self.config.rollout_batch_size
        bound = self.config.capacity
        if limit is not None and per_step is not None:
            bound = max(bound, (limit + 1) * per_step)
        if prompts > bound:
            # Admitted at once while little is alive, it would hold every later
            # reservation back until that many groups were put and taken.
            raise ConfigError(
                f"reserve({prompts}) asks for more prompts than one reservation may take: at "
                f"most {bound} (the Buffer's capacity, or (max_staleness + 1) * "
                "rollout_batch_size when larger); reserve a round at a time"
            )
        while limit is not None and per_step is not None:
            # In prompts: a multi-agent prompt leaves one ready group per role.
            alive = self._stats.in_flight + len({g.group_id for g in self._ready})
            if alive < per_step or alive + prompts <= (limit + 1) * per_step:
                break
            changed = self._changed
            await changed.wait()
            self._check_open()
        self._stats.in_flight += prompts

    async def release(self, prompts: int = 1) -> None:
        """Give back reservations for rollouts that will not be put (cancelled); more than
        are reserved and not yet put is a :class:`ConfigError`."""
        _check_count("release", prompts)
        if prompts > self._stats.in_flight:
            raise ConfigError(
                f"release({prompts}) gives back more prompts than are reserved and not yet "
                f"put ({self._stats.in_flight}): release only what reserve took and no "
                "put_group followed"
            )
        self._stats.in_flight = max(0, self._stats.in_flight - prompts)
        self._notify()

    # -- consuming -----------------------------------------------------------------------
    async def get_batch(
        self,
        groups: int | None = None,
        *,
        policy_version: int | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a deadline for the wait, as Queue.get
        lease_s: float | None = None,
    ) -> Batch:
        """The next ``groups`` ready groups (default ``rollout_batch_size``), oldest first.

        Waits until enough are ready (``TimeoutError`` after ``timeout`` seconds). Groups
        too stale for ``policy_version`` are dropped or recycled on the way. With
        ``lease_s``, the batch is lent for that long: unless :meth:`renew` extends the
        lease (or ``ack``/``release_batch`` settles the batch) in time, its groups go back
        to the front of the ready queue for the next consumer. Without, the batch stays
        handed out until it is settled (or :meth:`rewind`).
        """
        self._check_open()
        n = groups or self.config.rollout_batch_size
        if n is None or n < 1:
            raise ConfigError(
                "get_batch needs a number of groups (or BufferConfig.rollout_batch_size)"
            )
        if n > self.config.capacity:
            raise ConfigError(
                f"a batch of {n} groups can never fill a capacity of {self.config.capacity}"
            )
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            raise ConfigError(
                f"get_batch's timeout must be a number of seconds >= 0 (or None: wait as long "
                f"as it takes), got {timeout!r}"
            )
        if lease_s is not None and not (
            isinstance(lease_s, (int, float)) and 0 < lease_s < math.inf
        ):
            raise ConfigError(
                f"lease_s must be a finite number of seconds > 0 (or None: no lease), "
                f"got {lease_s!r}"
            )
        if policy_version is not None:
            await self.set_policy_version(policy_version)
        with anyio.fail_after(None if timeout is None or math.isinf(timeout) else timeout):
            while True:
                self._expire_leases()
                await self._drop_stale()
                if len(self._ready) >= n:
                    break
                changed = self._changed
                # A lease that runs out returns groups: wake for it too.
                wake = min(self._leases.values(), default=math.inf)
                with anyio.move_on_after(wake - anyio.current_time()):
                    await changed.wait()
                self._check_open()
        taken = tuple(self._ready.popleft() for _ in range(n))
        batch = Batch(uuid.uuid4().hex, taken, self._stats.policy_version, lease_s)
        self._handed[batch.id] = batch
        if lease_s is not None:
            self._leases[batch.id] = anyio.current_time() + lease_s
        self._stats.handed += n
        self._stats.batches += 1
        self._notify()  # room for producers
        return batch

    # -- leases --------------------------------------------------------------------------
    def _expire_leases(self) -> None:
        """Every batch whose lease ran out goes back to the front of the ready queue."""
        if not self._leases:
            return
        now = anyio.current_time()
        gone = [batch_id for batch_id, deadline in self._leases.items() if deadline <= now]
        if not gone:
            return
        back: list[Group] = []
        for batch_id in gone:
            del self._leases[batch_id]
            batch = self._handed.pop(batch_id)
            back.extend(batch.groups)
            self._stats.handed -= len(batch.groups)
            self._stats.leases_expired += 1
            self._expired[batch_id] = batch
            if len(self._expired) > _EXPIRED_KEPT:
                self._expired.popitem(last=False)
        back.sort(key=lambda g: g.seq)  # oldest first, as they were put
        self._ready.extendleft(reversed(back))
        self._notify()

    def _handed_batch(self, batch_id: str) -> Batch:
        """The handed-out batch ``batch_id``; an expired one is handed back to its consumer
        if none of its groups has left the ready queue meanwhile (handed to another
        consumer, or dropped as stale)."""
        self._expire_leases()
        if batch_id in self._handed:
            return self._handed[batch_id]
        batch = self._expired.get(batch_id)
        if batch is None:
            raise UnknownBatchError(
                f"unknown batch {batch_id!r}: not handed out by this Buffer, or already "
                "acknowledged or released"
            )
        seqs = {g.seq for g in batch.groups}
        if sum(g.seq in seqs for g in self._ready) != len(seqs):
            raise LeaseExpiredError(
                f"the lease of batch {batch_id!r} ran out (no renewal within {batch.lease_s} "
                "s) and its groups were handed to another consumer or dropped meanwhile: do "
                "not commit the step that trained on it (renew leases while a step runs: "
                "BufferClient does it in the background)"
            )
        del self._expired[batch_id]
        self._ready = collections.deque(g for g in self._ready if g.seq not in seqs)
        self._handed[batch_id] = batch
        self._stats.handed += len(batch.groups)
        return batch

    async def renew(self, batch: Batch | str) -> None:
        """Extend a leased batch's lease by its ``lease_s`` from now.

        A batch whose lease ran out is taken back if all its groups are still ready;
        otherwise :class:`LeaseExpiredError`. Batches without a lease need no renewal.
        """
        self._check_open()
        batch_id = batch if isinstance(batch, str) else batch.id
        taken = self._handed_batch(batch_id)
        if taken.lease_s is not None:
            self._leases[batch_id] = anyio.current_time() + taken.lease_s

    # -- staleness on the way out --------------------------------------------------------
    async def drop_stale(self) -> int:
        """Drop (or recycle) the ready groups too stale for the current policy version now,
        rather than when a batch is next taken; returns how many went."""
        self._check_open()
        before = len(self._ready)
        await self._drop_stale()
        return before - len(self._ready)

    async def _drop_stale(self) -> None:
        if self.config.max_staleness is None:
            return
        stale = [g for g in self._ready if self._is_stale(g.version)]
        if not stale:
            return
        states: dict[str, list[int]] = {}
        for g in stale:
            self._ready.remove(g)
            _, reason = self._stale_state(g.task_id)
            states.setdefault(reason, []).append(g.seq)
        async with self._lock:
            for reason, seqs in states.items():
                await self._call(self._store.set_state, seqs, "stale", reason)

    # -- settling ------------------------------------------------------------------------
    async def ack(self, batch: Batch | str, *, step: int | None = None) -> None:
        """The trainer committed ``batch`` (as step ``step``): its groups are consumed.

        Durable before it returns. Unknown or already-settled batch ids raise
        :class:`UnknownBatchError`. A batch whose lease ran out is still acknowledged
        while none of its groups has been handed out again; else
        :class:`LeaseExpiredError`, and the step must not be committed.
        """
        self._check_open()
        _check_step(step)
        batch_id = batch if isinstance(batch, str) else batch.id
        deadline = self._leases.get(batch_id)
        # Out of the handed batches while the commit runs: its lease cannot run out (and
        # hand its groups to another consumer) halfway, and a second ack finds nothing.
        taken = self._handed_batch(batch_id)
        del self._handed[batch_id]
        self._leases.pop(batch_id, None)
        try:
            # Joins the group commit: one transaction and fsync with the puts waiting then.
            await self._commit([], [Consumed([g.seq for g in taken.groups], step)])
        except BaseException:
            self._handed[batch_id] = taken
            if taken.lease_s is not None:
                self._leases[batch_id] = deadline or anyio.current_time() + taken.lease_s
            raise
        self._stats.handed -= len(taken.groups)
        self._stats.consumed += len(taken.groups)

    async def release_batch(self, batch: Batch | str) -> None:
        """Put an unacknowledged batch back at the front (the step failed).

        Releasing a batch whose lease ran out is a no-op: its groups went back already.
        """
        batch_id = batch if isinstance(batch, str) else batch.id
        self._expire_leases()
        taken = self._handed.pop(batch_id, None)
        self._leases.pop(batch_id, None)
        if taken is None:
            if self._expired.pop(batch_id, None) is not None:
                return
            raise UnknownBatchError(f"unknown batch {batch_id!r}")
        self._ready.extendleft(reversed(taken.groups))
        self._stats.handed -= len(taken.groups)
        self._notify()

    async def position(self) -> int | None:
        """The last acknowledged step: save it with the trainer's checkpoint."""
        return self._store.last_step()

    async def rewind(self, step: int) -> int:
        """Resume from a checkpoint at ``step``: groups consumed by later steps become ready
        again (they were never committed with a checkpoint), and so do the groups of every
        batch handed out and not acknowledged (their consumer is gone: acknowledging them
        later raises :class:`UnknownBatchError`). Returns how many became ready."""
        self._check_open()
        _check_step(step)
        async with self._lock:
            records = await self._call(self._store.rewind, step)
        back = [self._group(r) for r in records]
        for taken in self._handed.values():
            back.extend(taken.groups)
        self._stats.handed = 0
        self._handed.clear()
        self._leases.clear()
        self._expired.clear()
        back.sort(key=lambda g: g.seq)
        self._ready.extendleft(reversed(back))
        self._stats.consumed -= min(self._stats.consumed, len(records))
        self._notify()
        return len(back)

    async def steps_after(self, step: int) -> dict[int, int]:
        """How many groups each acknowledged step after ``step`` consumed (what
        :meth:`rewind` to ``step`` gives back, step by step, oldest step first): a resumed
        trainer takes as many again for each step it redoes. Empty in memory."""
        self._check_open()
        _check_step(step)
        async with self._lock:
            return await self._call(self._store.steps_after, step)

    async def known_groups(self, group_ids: Sequence[str]) -> set[str]:
        """Those of ``group_ids`` stored, whatever became of them (kept, dropped, consumed):
        a producer resuming a round plays only the others."""
        self._check_open()
        async with self._lock:
            return await self._call(self._store.known_groups, list(group_ids))

    async def set_note(self, key: str, value: Any) -> None:
        """Keep ``value`` (JSON-able) under ``key`` with the groups -- a producer's or
        consumer's own small record, e.g. where its task stream stands -- as durable as a
        put (a later put's commit implies it). Replaces what ``key`` held."""
        self._check_open()
        text = json.dumps(value)
        async with self._lock:
            await self._call(self._store.set_note, key, text)

    async def note(self, key: str) -> Any:
        """What :meth:`set_note` kept under ``key`` (``None``: nothing)."""
        self._check_open()
        async with self._lock:
            text = await self._call(self._store.note, key)
        return None if text is None else json.loads(text)

    async def statistics(self) -> BufferStats:
        """A snapshot of the counters."""
        self._expire_leases()
        dropped = collections.Counter(self._stats.dropped)
        return dataclasses.replace(self._stats, ready=len(self._ready), dropped=dropped)
