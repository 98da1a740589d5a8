"""One long-lived thread for the engine's model work.

Steps must not hop between threads: each thread that calls into torch's CPU kernels gets a
team of OpenMP threads of its own, and an idle team spins for a while after its work --
on a small machine two teams fight over the cores. Measured on 2 cores, a decode step at
batch 32: 132-138 ms with all torch work on one thread, 166 ms on a second thread after the
first had used torch, and ~1.7x as long when successive steps ran on different threads.
So the engine loads its model and runs every step on one thread of its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from agentenv._errors import ClosedResourceError

__all__ = ["ModelThread"]

T = TypeVar("T")


class ModelThread:
    """Runs functions one at a time on a dedicated daemon thread, awaited from async code."""

    def __init__(self, name: str = "agentenv-engine") -> None:
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]] | None
        ] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            try:
                value = fn()
            except BaseException as e:  # handed to the caller
                outcome: tuple[Any, BaseException | None] = (None, e)
            else:
                outcome = (value, None)
            with contextlib.suppress(Exception):  # the caller's loop is gone: nobody waits
                done(*outcome)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread and wait for it, from synchronous code (loading
        the model there keeps all of the engine's torch work on one thread)."""
        self._check_open()
        box: concurrent.futures.Future[T] = concurrent.futures.Future()

        def done(value: Any, error: BaseException | None) -> None:
            if error is not None:
                box.set_exception(error)
            else:
                box.set_result(value)

        self._jobs.put((lambda: fn(*args), done))
        return box.result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread. Like ``anyio.to_thread.run_sync``, cancelling
        the caller waits for the call to end (the model must not be left mid-step)."""
        self._check_open()
        token = anyio.lowlevel.current_token()
        finished = anyio.Event()
        result: list[Any] = []

        def done(value: Any, error: BaseException | None) -> None:
            result.append((value, error))
            anyio.from_thread.run_sync(finished.set, token=token)

        self._jobs.put((lambda: fn(*args), done))
        with anyio.CancelScope(shield=True):
            await finished.wait()
        value, error = result[0]
        if error is not None:
            raise error
        return value  # type: ignore[no-any-return]

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("the engine is closed")

    def close(self) -> None:
        """Let the thread end once the work queued so far is done (does not wait)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    async def aclose(self) -> None:
        """:meth:`close`, then wait (in a worker thread, a few seconds at most) for the
        thread to end: a thread still inside torch when the interpreter exits can abort it."""
        self.close()
        await anyio.to_thread.run_sync(self._thread.join, 5.0)
