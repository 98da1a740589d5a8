"""Answer equivalence with Hugging Face's ``math-verify``, in worker processes.

``math-verify`` bounds its work with ``signal.alarm``, which works only in a process's
main thread, and an answer such as ``9^{9^{9^{9}}}`` keeps sympy busy in C code no signal
interrupts. So each check runs in a worker process's main thread, and a worker that does
not answer in ``timeout_s`` is killed and replaced (the check is a timeout); its start is
not counted in any check's time. :meth:`MathVerifier.equivalent` blocks: call it from a
worker thread, never the event loop."""

from __future__ import annotations

import enum
import multiprocessing
import queue
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

from agentenv._errors import ConfigError, at_least, positive

__all__ = ["Equivalence", "MathVerifier"]

_MAX_CHARS = 1000  # longer answers are not worth sympy's time (nor a worker's)
_READY = "ready"  # a worker's first message: its imports are done
_START_S = 300.0  # a worker that has not loaded math-verify by then is taken for dead


class Equivalence(enum.Enum):
    """How an answer compares with the reference, as ``math-verify`` reads them."""

    EQUAL = "equal"
    DIFFERENT = "different"
    LABEL_UNPARSEABLE = "label not parseable by math-verify"
    ANSWER_UNPARSEABLE = "answer not parseable by math-verify"
    TOO_LONG = f"answer longer than {_MAX_CHARS} characters"
    TIMEOUT = "math-verify timed out"


def _check(gold: str, answer: str) -> str:
    """In a worker's main thread: both read as the content of a ``\\boxed{}``."""
    from math_verify import parse, verify

    # no_fallback: what is not mathematics parses to nothing, rather than to its own text.
    parsed_gold = parse("\\boxed{" + gold + "}", fallback_mode="no_fallback")
    if not parsed_gold:
        return str(Equivalence.LABEL_UNPARSEABLE.value)
    parsed = parse("\\boxed{" + answer + "}", fallback_mode="no_fallback")
    if not parsed:
        return str(Equivalence.ANSWER_UNPARSEABLE.value)
    same = bool(verify(parsed_gold, parsed))
    return str((Equivalence.EQUAL if same else Equivalence.DIFFERENT).value)


def _serve(conn: Connection) -> None:
    """A worker: says it is ready once math-verify is loaded, then (gold, answer) pairs in,
    :class:`Equivalence` values out, until EOF."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # its timeouts: ours to report
    _check("1", "1")  # math-verify, sympy and the LaTeX parser load: the worker's start
    conn.send(_READY)
    while True:
        try:
            gold, answer = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = _check(gold, answer)
        except Exception:  # math-verify's own timeout, or a sympy error: not parseable
            result = Equivalence.ANSWER_UNPARSEABLE.value
        conn.send(result)


class _Worker:
    def __init__(self, context: Any) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.ready = False

    def ask(self, gold: str, answer: str, timeout_s: float) -> str | None:
        """The worker's answer, or ``None`` when it took longer than ``timeout_s`` (its
        start, up to ``_START_S``, is not the check's time)."""
        if not self.ready:
            if not self.conn.poll(_START_S) or self.conn.recv() != _READY:
                return None
            self.ready = True
        self.conn.send((gold, answer))
        if not self.conn.poll(timeout_s):
            return None
        return str(self.conn.recv())

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
    workers.clear()


class MathVerifier:
    """Checks answers against references with ``math-verify`` (the ``rewards`` extra) in
    up to ``max_workers`` worker processes, started on first use; ``timeout_s`` bounds one
    check. Thread-safe; :meth:`close` stops the workers (they also end with this
    process)."""

    def __init__(self, *, max_workers: int = 2, timeout_s: float = 10.0) -> None:
        self.max_workers = at_least("max_workers", max_workers, 1)
        self.timeout_s = positive("timeout_s", timeout_s)
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _kill_all, self._all)

    @staticmethod
    def available() -> bool:
        """Whether ``math-verify`` is installed."""
        import importlib.util

        return importlib.util.find_spec("math_verify") is not None

    def _borrow(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if len(self._all) < self.max_workers:
                if not self.available():
                    raise ConfigError(
                        "math answers are checked with math-verify, which is not installed: "
                        "pip install 'agentenv[rewards]' (or math-verify==0.9.0)"
                    )
                worker = _Worker(multiprocessing.get_context("spawn"))
                self._all.append(worker)
                return worker
        return self._idle.get()

    def equivalent(self, gold: str, answer: str) -> Equivalence:
        """How ``answer`` compares with ``gold`` (blocking: call it from a worker thread)."""
        if len(answer) > _MAX_CHARS:
            return Equivalence.TOO_LONG
        worker = self._borrow()
        try:
            result = worker.ask(gold, answer, self.timeout_s)
        except (OSError, EOFError):  # the worker died: replace it
            result = None
        if result is None:
            with self._lock:
                worker.kill()
                self._all.remove(worker)
            return Equivalence.TIMEOUT
        self._idle.put(worker)
        return Equivalence(result)

    def close(self) -> None:
        """Stop the worker processes (a later check starts new ones)."""
        with self._lock:
            self._finalizer()
            self._finalizer = weakref.finalize(self, _kill_all, self._all)
            while True:
                try:
                    self._idle.get_nowait()
                except queue.Empty:
                    break
