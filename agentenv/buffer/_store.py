"""Where the Buffer keeps its groups: in memory, or in a crash-safe SQLite file.

The store records what must survive a crash -- every group put (kept or dropped, with
its samples), and which groups a trainer step consumed -- and nothing about in-flight
state: a batch handed out but not acknowledged is simply still ``ready`` on disk, so it
is handed out again after a restart.

SQLite in WAL mode. With ``durability="power"`` (``synchronous=FULL``) a transaction is
on disk when ``commit`` returns, surviving power loss; with ``"process"``
(``synchronous=NORMAL``) it is in the OS page cache, which survives a killed process
(``kill -9``) but not a kernel crash or power cut. Either way a process killed at any
instant leaves the last committed state. One
transaction per group commit (several puts at once), so durability costs one fsync per
batch of puts, not per sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from agentenv._errors import AgentEnvError, ConfigError
from agentenv._sample import Sample
from agentenv.buffer._codec import decode_sample, encode_sample

__all__ = ["BufferStoreError", "GroupRecord", "MemoryStore", "SqliteStore", "Store"]

FORMAT = "agentenv-buffer"
VERSION = "1"
FILENAME = "buffer.sqlite"


class BufferStoreError(AgentEnvError):
    """The durable store failed (disk full, I/O error, foreign file); nothing was half-written."""


@dataclasses.dataclass(slots=True)
class GroupRecord:
    """One group as stored: its samples and what became of it."""

    group_id: str
    role: str | None
    task_id: str | None
    samples: list[Sample]
    state: str  # ready | consumed | dropped | stale
    reason: str = ""
    version: int | None = None
    seq: int = 0
    step: int | None = None
    blobs: list[bytes] | None = None  # the samples encoded, when the caller did it already


class Store(Protocol):
    """What the Buffer needs from a store. Methods are synchronous (run off the loop)."""

    def put(self, records: Sequence[GroupRecord]) -> list[bool]:
        """Store records in one transaction; per record, True if it was new (else a duplicate)."""
        ...

    def consume(self, seqs: Sequence[int], step: int | None) -> None:
        """Mark groups consumed by ``step``."""
        ...

    def set_state(self, seqs: Sequence[int], state: str, reason: str) -> None:
        """Record a later decision about ready groups (stale)."""
        ...

    def rewind(self, step: int) -> list[GroupRecord]:
        """Groups consumed by steps after ``step`` become ready again; returns them."""
        ...

    def ready(self) -> list[GroupRecord]:
        """Every ready group, oldest first (at open)."""
        ...

    def last_step(self) -> int | None:
        """The highest step that consumed a group."""
        ...

    def close(self) -> None: ...


class MemoryStore:
    """Keeps only what deduplication needs: the ids seen."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._seq = 0
        self._last_step: int | None = None

    def put(self, records: Sequence[GroupRecord]) -> list[bool]:
        out = []
        for r in records:
            ids = [s.id for s in r.samples if s.id is not None]
            new = not ids or not all(i in self._ids for i in ids)
            if new:
                self._ids.update(ids)
                self._seq += 1
                r.seq = self._seq
            out.append(new)
        return out

    def consume(self, seqs: Sequence[int], step: int | None) -> None:
        if step is not None:
            self._last_step = step if self._last_step is None else max(self._last_step, step)

    def set_state(self, seqs: Sequence[int], state: str, reason: str) -> None:
        return None

    def rewind(self, step: int) -> list[GroupRecord]:
        raise ConfigError("rewind needs a durable Buffer (Buffer(path=...))")

    def ready(self) -> list[GroupRecord]:
        return []

    def last_step(self) -> int | None:
        return self._last_step

    def close(self) -> None:
        return None


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id TEXT NOT NULL,
    role TEXT NOT NULL,
    task_id TEXT,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    version INTEGER,
    step INTEGER,
    n_samples INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS groups_state ON groups (state, seq);
CREATE TABLE IF NOT EXISTS samples (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    pos INTEGER NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_seq ON samples (seq, pos);
"""


class SqliteStore:
    """A crash-safe store in ``DIR/buffer.sqlite``."""

    def __init__(self, directory: str | os.PathLike[str], *, durability: str = "power") -> None:
        root = Path(directory)
        if root.exists() and not root.is_dir():
            raise ConfigError(f"buffer path {str(root)!r} exists and is not a directory")
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / FILENAME
        existed = self.path.exists() and self.path.stat().st_size > 0
        if existed:
            with self.path.open("rb") as f:
                magic = f.read(16)
            if magic != b"SQLite format 3\x00":
                raise ConfigError(
                    f"{str(self.path)!r} is not an agentenv buffer (not a SQLite file); "
                    "refusing to touch it: choose another --path"
                )
        try:
            if existed:  # read-only first: a foreign file must not be changed at all
                probe = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
                try:
                    self._check_format(probe)
                finally:
                    probe.close()
            # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            if not existed:
                # Samples are ~8 KB blobs: big pages avoid chains of overflow pages.
                self._db.execute("PRAGMA page_size=65536")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={'FULL' if durability == 'power' else 'NORMAL'}")
            if not existed:
                self._db.executescript(_SCHEMA)
                self._db.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [("format", FORMAT), ("version", VERSION)],
                )
        except sqlite3.DatabaseError as e:
            raise ConfigError(
                f"{str(self.path)!r} cannot be opened as an agentenv buffer: {e}; "
                "refusing to touch it: choose another --path"
            ) from None

    def _check_format(self, db: sqlite3.Connection) -> None:
        try:
            rows = dict(db.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError:
            rows = {}
        if rows.get("format") != FORMAT:
            raise ConfigError(
                f"{str(self.path)!r} is a SQLite file but not an agentenv buffer; "
                "refusing to touch it: choose another --path"
            )
        if rows.get("version") != VERSION:
            raise ConfigError(
                f"{str(self.path)!r} is buffer format version {rows.get('version')}, "
                f"this agentenv reads version {VERSION}"
            )

    def _transaction(self, work: str) -> _Tx:
        return _Tx(self._db, work)

    def put(self, records: Sequence[GroupRecord]) -> list[bool]:
        blobs = [r.blobs or [encode_sample(s) for s in r.samples] for r in records]
        all_ids = [s.id for r in records for s in r.samples]
        with self._transaction("put"):
            db = self._db
            # Three statements per commit, whatever its size: one lookup of every id,
            # then one insert of all groups and one of all samples.
            known: set[str] = set()
            for i in range(0, len(all_ids), 900):  # SQLite's bound-parameter limit
                chunk = all_ids[i : i + 900]
                marks = ",".join("?" * len(chunk))
                known.update(
                    row[0]
                    for row in db.execute(f"SELECT id FROM samples WHERE id IN ({marks})", chunk)
                )
            (last,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM groups").fetchone()
            out: list[bool] = []
            group_rows: list[tuple[object, ...]] = []
            sample_rows: list[tuple[str | None, int, int, bytes]] = []
            for r, encoded in zip(records, blobs, strict=True):
                ids = [s.id for s in r.samples]
                hits = sum(1 for i in ids if i in known)
                if ids and hits == len(ids):
                    out.append(False)
                    continue
                if hits:
                    raise ConfigError(
                        f"group {r.group_id!r}: {hits} of its {len(ids)} sample ids are "
                        "already stored under another group; sample ids must be unique"
                    )
                known.update(i for i in ids if i is not None)
                last += 1
                r.seq = last
                group_rows.append(
                    (
                        last,
                        r.group_id,
                        r.role or "",
                        r.task_id,
                        r.state,
                        r.reason,
                        r.version,
                        len(r.samples),
                    )
                )
                sample_rows.extend(
                    (sid, last, pos, blob)
                    for pos, (sid, blob) in enumerate(zip(ids, encoded, strict=True))
                )
                out.append(True)
            db.executemany(
                "INSERT INTO groups (seq, group_id, role, task_id, state, reason, version, "
                "n_samples) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                group_rows,
            )
            db.executemany(
                "INSERT INTO samples (id, seq, pos, data) VALUES (?, ?, ?, ?)", sample_rows
            )
        return out

    def consume(self, seqs: Sequence[int], step: int | None) -> None:
        with self._transaction("acknowledge"):
            self._db.executemany(
                "UPDATE groups SET state = 'consumed', step = ? WHERE seq = ?",
                [(step, s) for s in seqs],
            )

    def set_state(self, seqs: Sequence[int], state: str, reason: str) -> None:
        with self._transaction("update"):
            self._db.executemany(
                "UPDATE groups SET state = ?, reason = ? WHERE seq = ?",
                [(state, reason, s) for s in seqs],
            )

    def rewind(self, step: int) -> list[GroupRecord]:
        with self._transaction("rewind"):
            seqs = [
                row[0]
                for row in self._db.execute(
                    "SELECT seq FROM groups WHERE state = 'consumed' AND step > ? ORDER BY seq",
                    (step,),
                )
            ]
            self._db.executemany(
                "UPDATE groups SET state = 'ready', step = NULL WHERE seq = ?",
                [(s,) for s in seqs],
            )
        return self._load(seqs)

    def ready(self) -> list[GroupRecord]:
        seqs = [
            row[0]
            for row in self._db.execute("SELECT seq FROM groups WHERE state = 'ready' ORDER BY seq")
        ]
        return self._load(seqs)

    def _load(self, seqs: Iterable[int]) -> list[GroupRecord]:
        out = []
        for seq in seqs:
            row = self._db.execute(
                "SELECT group_id, role, task_id, state, reason, version, step FROM groups "
                "WHERE seq = ?",
                (seq,),
            ).fetchone()
            samples = [
                decode_sample(data)
                for (data,) in self._db.execute(
                    "SELECT data FROM samples WHERE seq = ? ORDER BY pos", (seq,)
                )
            ]
            out.append(
                GroupRecord(
                    group_id=row[0],
                    role=row[1] or None,
                    task_id=row[2],
                    samples=samples,
                    state=row[3],
                    reason=row[4],
                    version=row[5],
                    seq=seq,
                    step=row[6],
                )
            )
        return out

    def last_step(self) -> int | None:
        (step,) = self._db.execute("SELECT MAX(step) FROM groups").fetchone()
        return None if step is None else int(step)

    def close(self) -> None:
        self._db.close()


class _Tx:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back on any error (nothing half-written)."""

    def __init__(self, db: sqlite3.Connection, work: str) -> None:
        self._db = db
        self._work = work

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            try:
                self._db.execute("COMMIT")
                return
            except sqlite3.Error as e:
                self._rollback()
                raise BufferStoreError(f"buffer {self._work} failed: {e}") from None
        self._rollback()
        if isinstance(exc, sqlite3.Error):
            raise BufferStoreError(f"buffer {self._work} failed: {exc}") from None

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):  # no transaction left to roll back
            self._db.execute("ROLLBACK")
