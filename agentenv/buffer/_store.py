"""Where the Buffer keeps its groups: in memory, or crash-safe on disk (the guarantees:
docs/buffer.md, "Durability").

The store records what must survive a crash -- every group put (kept or dropped, with
its samples), and which groups a trainer step consumed -- and nothing about in-flight
state: a batch handed out but not acknowledged is simply still ``ready`` on disk.

On disk, ``samples.log`` holds the encoded samples back to back and ``buffer.sqlite``
(SQLite, WAL) indexes them and holds the groups' states and the notes (``meta``). A put
appends to the log first, then commits its index rows: a sample is stored exactly when
its row is committed, and bytes past the last indexed one (a put that never committed)
are cut off at the next open -- which is why a second opener, who would cut off a put
the first has written but not yet indexed, is refused (:class:`DirectoryLock`). With
``durability="power"`` the log is fsynced before the commit and SQLite runs with
``synchronous=FULL``; with ``"process"`` both stay in the OS page cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from agentenv._errors import AgentEnvError, ConfigError
from agentenv._sample import Sample
from agentenv.buffer._codec import decode_sample, encode_sample

__all__ = [
    "BufferLockedError",
    "BufferStoreError",
    "Consumed",
    "GroupRecord",
    "MemoryStore",
    "SampleLog",
    "SqliteStore",
    "Store",
    "StoreReader",
    "open_readonly",
]

FORMAT = "agentenv-buffer"
VERSION = "2"
FILENAME = "buffer.sqlite"
LOCK_FILENAME = "buffer.lock"
_NOTE = "note:"  # the prefix of the notes' keys in the meta table


class BufferStoreError(AgentEnvError):
    """The durable store failed (disk full, I/O error, foreign file); nothing was half-written."""


class BufferLockedError(ConfigError):
    """Another process (or another Buffer in this one) has the Buffer directory open."""


class DirectoryLock:
    """An exclusive ``flock`` on the directory itself, until :meth:`release` (or the
    process's end: the kernel drops it then, whatever killed it).

    The lock is on the directory's own inode, which cannot be replaced while the store's
    files are in it: removing or rewriting ``DIR/buffer.lock`` changes nothing. That file
    only names the holder's pid for the error message.
    """

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK_FILENAME
        self._fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            try:
                holder = self.path.read_text(errors="replace").strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise BufferLockedError(
                f"the Buffer directory {str(root)!r} is open in process {holder} (it holds "
                "the directory's lock); one process per Buffer directory: to share a Buffer "
                "between processes, serve it (`agentenv buffer serve --path ...`) and "
                "connect with BufferClient, or close the other Buffer first"
            ) from None
        except BaseException:
            os.close(self._fd)
            raise
        with contextlib.suppress(OSError):  # only informative: the lock holds without it
            self.path.write_text(f"{os.getpid()}\n")

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)  # drops the lock


@dataclasses.dataclass(slots=True, frozen=True)
class Consumed:
    """An acknowledged batch: its groups (by ``seq``) were consumed by trainer ``step``."""

    seqs: list[int]
    step: int | None


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
    offset: int = 0  # where the first blob starts in the sample log, once staged


class MemoryStore:
    """Keeps only what deduplication needs: the ids seen."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._groups: set[str] = set()
        self._notes: dict[str, str] = {}
        self._seq = 0
        self._last_step: int | None = None

    blocks = False

    def stage(self, records: Sequence[GroupRecord]) -> None:
        return None

    def commit(
        self, records: Sequence[GroupRecord], consumed: Sequence[Consumed] = ()
    ) -> list[bool]:
        for c in consumed:
            if c.step is not None:
                last = self._last_step
                self._last_step = c.step if last is None else max(last, c.step)
        out = []
        for r in records:
            ids = [s.id for s in r.samples if s.id is not None]
            new = not ids or not all(i in self._ids for i in ids)
            if new:
                self._ids.update(ids)
                self._groups.add(r.group_id)
                self._seq += 1
                r.seq = self._seq
            out.append(new)
        return out

    def set_state(self, seqs: Sequence[int], state: str, reason: str) -> None:
        return None

    def rewind(self, step: int) -> list[GroupRecord]:
        raise ConfigError("rewind needs a durable Buffer (Buffer(path=...))")

    def ready(self) -> list[GroupRecord]:
        return []

    def last_step(self) -> int | None:
        return self._last_step

    def steps_after(self, step: int) -> dict[int, int]:
        return {}  # nothing to rewind in memory

    def known_groups(self, group_ids: Sequence[str]) -> set[str]:
        return self._groups.intersection(group_ids)

    def set_note(self, key: str, value: str) -> None:
        self._notes[key] = value

    def note(self, key: str) -> str | None:
        return self._notes.get(key)

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
    offset INTEGER NOT NULL,
    length INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_seq ON samples (seq, pos);
"""

LOG_FILENAME = "samples.log"
LOG_MAGIC = b"agentenv samples log 1\n"


class SampleLog:
    """``samples.log``: encoded samples appended back to back after a magic line."""

    def __init__(self, path: Path, *, writable: bool) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            if os.pread(self.fd, len(LOG_MAGIC), 0) != LOG_MAGIC:
                raise ConfigError(
                    f"{str(path)!r} is not an agentenv samples log; refusing to touch it"
                )
            self.size = os.fstat(self.fd).st_size
        except BaseException:
            os.close(self.fd)
            raise

    @classmethod
    def create(cls, path: Path) -> SampleLog:
        """A new, empty log; refuses to replace an existing file."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, LOG_MAGIC)
            os.fsync(fd)
        finally:
            os.close(fd)
        return cls(path, writable=True)

    def read(self, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise BufferStoreError(
                f"{str(self.path)!r} ends at byte {self.size}, before the sample indexed at "
                f"{offset}+{length}: the log was truncated or replaced"
            )
        return data

    def append(self, blobs: Sequence[bytes]) -> int:
        """Write ``blobs`` at the end (not synced); returns where they start.

        Cut back on any error."""
        start = self.size
        total = sum(len(b) for b in blobs)
        done = 0
        try:
            # One system call per 512 blobs, without joining them first.
            for i in range(0, len(blobs), 512):
                chunk = blobs[i : i + 512]
                size = sum(len(b) for b in chunk)
                wrote = os.pwritev(self.fd, chunk, start + done)
                if wrote < size:  # short write: the rest one by one
                    rest = memoryview(b"".join(chunk))
                    while wrote < size:
                        wrote += os.pwrite(self.fd, rest[wrote:], start + done + wrote)
                done += size
        except OSError as e:
            self.truncate(start)
            raise BufferStoreError(f"buffer put failed: writing {LOG_FILENAME}: {e}") from None
        self.size = start + total
        return start

    def truncate(self, end: int) -> None:
        """Drop every byte past ``end`` (what an uncommitted put appended)."""
        with contextlib.suppress(OSError):  # best effort: bytes past the index are ignored
            os.ftruncate(self.fd, end)
            self.size = end

    def close(self) -> None:
        os.close(self.fd)


_REFUSE = "; refusing to touch it: choose another --path"


def _check_magic(file: Path, hint: str = "") -> None:
    with file.open("rb") as f:
        if f.read(16) != b"SQLite format 3\x00":
            raise ConfigError(f"{str(file)!r} is not an agentenv buffer (not a SQLite file){hint}")


def _check_format(file: Path, meta: dict[str, str], hint: str = "") -> None:
    """``meta`` (the ``meta`` table's rows) is an agentenv buffer's, of this version."""
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{str(file)!r} is a SQLite file but not an agentenv buffer{hint}")
    if meta.get("version") != VERSION:
        raise ConfigError(
            f"{str(file)!r} is buffer format version {meta.get('version')}; this agentenv "
            f"reads version {VERSION}"
        )


def _select_in(db: sqlite3.Connection, query: str, values: Sequence[Any]) -> set[Any]:
    """The first column of ``query``'s rows, its ``IN ({})`` taking every one of ``values``
    (in pieces: SQLite bounds the parameters of one statement)."""
    found: set[Any] = set()
    for i in range(0, len(values), 900):
        chunk = values[i : i + 900]
        found.update(row[0] for row in db.execute(query.format(",".join("?" * len(chunk))), chunk))
    return found


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection, work: str) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back on any error (nothing half-written);
    SQLite's and the disk's errors raised as :class:`BufferStoreError`."""
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):  # no transaction left to roll back
                db.execute("ROLLBACK")
            raise
    except (OSError, sqlite3.Error) as e:
        raise BufferStoreError(f"buffer {work} failed: {e}") from None


class SqliteStore:
    """A crash-safe store in ``DIR/buffer.sqlite`` and ``DIR/samples.log``."""

    def __init__(self, directory: str | os.PathLike[str], *, durability: str = "power") -> None:
        root = Path(directory)
        if root.exists() and not root.is_dir():
            raise ConfigError(f"buffer path {str(root)!r} exists and is not a directory")
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / FILENAME
        self._sync = durability == "power"
        if self.path.exists() and self.path.stat().st_size > 0:  # before the lock: a
            _check_magic(self.path, _REFUSE)  # foreign directory gets no lock file
        self._lock = DirectoryLock(root)
        try:
            self._open(root)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, root: Path) -> None:
        # Under the lock: nobody else writes here, so what lies past the index is dead.
        log_path = root / LOG_FILENAME
        for stale in root.glob(f"{FILENAME}.new*"):  # a creation killed before its rename
            stale.unlink()
        if not (self.path.exists() and self.path.stat().st_size > 0):
            if log_path.exists():
                raise ConfigError(f"{str(log_path)!r} exists without its index {FILENAME}{_REFUSE}")
            self._create_index(root)
        _check_magic(self.path, _REFUSE)
        try:
            # Read-only first: a foreign file must not be changed at all.
            probe = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
            try:
                rows = dict(probe.execute("SELECT key, value FROM meta").fetchall())
            except sqlite3.DatabaseError:
                rows = {}
            finally:
                probe.close()
            _check_format(self.path, rows, _REFUSE)
            # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={'FULL' if self._sync else 'NORMAL'}")
        except sqlite3.DatabaseError as e:
            raise ConfigError(
                f"{str(self.path)!r} cannot be opened as an agentenv buffer: {e}{_REFUSE}"
            ) from None
        try:
            # The end of the last sample the index knows: the log's committed length.
            (end,) = self._db.execute("SELECT MAX(offset + length) FROM samples").fetchone()
            end = len(LOG_MAGIC) if end is None else int(end)
            if not log_path.exists():
                if end > len(LOG_MAGIC):
                    raise ConfigError(
                        f"{str(log_path)!r} is missing: the buffer's samples are gone; "
                        "restore the directory as a whole"
                    )
                # Nothing indexed yet: a creation killed between the index and the log.
                self._log = SampleLog.create(log_path)
                return
            self._log = SampleLog(log_path, writable=True)
            if self._log.size < end:
                raise ConfigError(
                    f"{str(log_path)!r} has {self._log.size} bytes but the index expects "
                    f"{end}: the log was truncated or replaced"
                )
            self._log.truncate(end)  # a put that crashed before its commit
        except BaseException:
            self._db.close()
            raise

    def _create_index(self, root: Path) -> None:
        """A new, empty index, whole or not at all: built beside its place, then renamed
        into it (a process killed while creating leaves no half-made index behind)."""
        tmp = root / f"{FILENAME}.new"
        db = sqlite3.connect(tmp, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(
                f"BEGIN; {_SCHEMA} INSERT INTO meta (key, value) VALUES "
                f"('format', '{FORMAT}'), ('version', '{VERSION}'); COMMIT;"
            )
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            db.close()  # the last connection: the WAL is folded in and removed
        _fsync(tmp)
        os.replace(tmp, self.path)
        _fsync(root)

    @property
    def blocks(self) -> bool:
        """Whether :meth:`commit` waits for the disk (then run it off the event loop)."""
        return self._sync

    def stage(self, records: Sequence[GroupRecord]) -> None:
        """Write the records' sample bodies to the log, not yet durable nor indexed. Called
        on the event loop, possibly while :meth:`commit` of earlier records runs in a
        thread (so the next puts' bytes go out during its fsync)."""
        payload = []
        for r in records:
            if r.blobs is None:
                r.blobs = [encode_sample(s) for s in r.samples]
            payload.extend(r.blobs)
        offset = self._log.append(payload)  # cuts back its own bytes on failure
        for r in records:
            r.offset = offset
            offset += sum(len(b) for b in r.blobs or ())

    def commit(
        self, records: Sequence[GroupRecord], consumed: Sequence[Consumed] = ()
    ) -> list[bool]:
        """Index staged records and mark ``consumed`` groups in one transaction, durably;
        per record, True if it was new (else a duplicate). All or nothing: on failure
        nothing changes (staged bytes without an index row are cut off at the next open)."""
        # The log reaches the disk before the index rows that point into it commit.
        with _transaction(self._db, "put"):
            flags = self._put(records) if records else []
            if consumed:
                self._db.executemany(
                    "UPDATE groups SET state = 'consumed', step = ? WHERE seq = ?",
                    [(c.step, seq) for c in consumed for seq in c.seqs],
                )
            if self._sync:
                os.fdatasync(self._log.fd)
        return flags

    def _put(self, records: Sequence[GroupRecord]) -> list[bool]:
        db = self._db
        all_ids = [s.id for r in records for s in r.samples]
        # Three statements per commit, whatever its size: one lookup of every id, then one
        # insert of all groups and one of all samples.
        known = _select_in(db, "SELECT id FROM samples WHERE id IN ({})", all_ids)
        (last,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM groups").fetchone()
        out: list[bool] = []
        group_rows: list[tuple[object, ...]] = []
        sample_rows: list[tuple[Any, ...]] = []
        for r in records:
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
            offset = r.offset
            for pos, (sid, blob) in enumerate(zip(ids, r.blobs or (), strict=True)):
                sample_rows.append((sid, last, pos, offset, len(blob)))
                offset += len(blob)
            out.append(True)
        db.executemany(
            "INSERT INTO groups (seq, group_id, role, task_id, state, reason, version, "
            "n_samples) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            group_rows,
        )
        db.executemany(
            "INSERT INTO samples (id, seq, pos, offset, length) VALUES (?, ?, ?, ?, ?)",
            sample_rows,
        )
        return out

    def set_state(self, seqs: Sequence[int], state: str, reason: str) -> None:
        with _transaction(self._db, "update"):
            self._db.executemany(
                "UPDATE groups SET state = ?, reason = ? WHERE seq = ?",
                [(state, reason, s) for s in seqs],
            )

    def rewind(self, step: int) -> list[GroupRecord]:
        """Groups consumed by steps after ``step`` become ready again; returns them."""
        with _transaction(self._db, "rewind"):
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
            gid, role, task, state, reason, version, step = self._db.execute(
                "SELECT group_id, role, task_id, state, reason, version, step FROM groups "
                "WHERE seq = ?",
                (seq,),
            ).fetchone()
            blobs = [
                self._log.read(offset, length)
                for offset, length in self._db.execute(
                    "SELECT offset, length FROM samples WHERE seq = ? ORDER BY pos", (seq,)
                )
            ]
            samples = [decode_sample(b) for b in blobs]
            record = GroupRecord(gid, role or None, task, samples, state, reason, version, seq)
            record.step, record.blobs = step, blobs
            out.append(record)
        return out

    def last_step(self) -> int | None:
        (step,) = self._db.execute("SELECT MAX(step) FROM groups").fetchone()
        return None if step is None else int(step)

    def steps_after(self, step: int) -> dict[int, int]:
        rows = self._db.execute(
            "SELECT step, COUNT(*) FROM groups WHERE state = 'consumed' AND step > ? "
            "GROUP BY step ORDER BY step",
            (step,),
        )
        return {int(k): int(n) for k, n in rows}

    def known_groups(self, group_ids: Sequence[str]) -> set[str]:
        query = "SELECT DISTINCT group_id FROM groups WHERE group_id IN ({})"
        return _select_in(self._db, query, group_ids)

    def set_note(self, key: str, value: str) -> None:
        # Notes live beside the format rows, under a prefix of their own.
        with _transaction(self._db, "note"):
            self._db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (_NOTE + key, value)
            )

    def note(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (_NOTE + key,)).fetchone()
        return None if row is None else str(row[0])

    def close(self) -> None:
        try:
            self._db.close()
            self._log.close()
        finally:
            self._lock.release()


Store = MemoryStore | SqliteStore
"""Where a Buffer keeps its groups; every method is synchronous (the Buffer runs a durable
store's off the event loop)."""


@dataclasses.dataclass(slots=True)
class StoreReader:
    """A Buffer on disk opened read-only: its index in one snapshot, and its samples."""

    db: sqlite3.Connection
    log: SampleLog

    def blob(self, offset: int, length: int) -> bytes:
        """The encoded sample the index places at ``offset``."""
        return self.log.read(offset, length)

    def close(self) -> None:
        self.db.close()
        self.log.close()


def open_readonly(path: Path) -> StoreReader:
    """The Buffer at ``path`` (its directory or its SQLite file), opened read-only.

    Raises :class:`ConfigError` naming the path when there is no agentenv Buffer there.
    """
    file = path / FILENAME if path.is_dir() else path
    if not file.exists():
        where = (
            f"{str(path)!r} has no {FILENAME}" if path.is_dir() else f"{str(path)!r} does not exist"
        )
        raise ConfigError(
            f"no Buffer found: {where}; pass the directory given to Buffer(path=...) or "
            "`agentenv buffer serve --path`"
        )
    _check_magic(file)
    # A Buffer that is open has its write-ahead log beside the file: read alongside it. A
    # closed one is read as immutable, so that not even SQLite's side files are created.
    live = file.with_name(file.name + "-wal").exists()
    mode = "mode=ro" if live else "mode=ro&immutable=1"
    try:
        db = sqlite3.connect(f"{file.resolve().as_uri()}?{mode}", uri=True, isolation_level=None)
        rows = dict(db.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.Error as e:
        raise ConfigError(f"{str(file)!r} cannot be read as an agentenv buffer: {e}") from None
    try:
        _check_format(file, rows)
    except ConfigError:
        db.close()
        raise
    db.execute("BEGIN")  # one snapshot for every query, even while the Buffer is served
    try:
        # Opened after the snapshot: every sample it indexes is in the file already.
        log = SampleLog(file.with_name(LOG_FILENAME), writable=False)
    except (OSError, ConfigError) as e:
        db.close()
        raise ConfigError(f"the Buffer's samples at {str(path)!r} cannot be read: {e}") from None
    return StoreReader(db, log)
