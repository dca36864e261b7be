"""Long-lived I/O threads, shared by every save and load of the process.

Each I/O thread keeps its page-aligned bounce buffer (ckptd.storage.local) for its whole
life. Creating threads per save meant fresh buffers per save, and a fresh buffer's first
O_DIRECT transfer pays for faulting and pinning every page: the benchmark measured cold
reads at about half the raw speed that way. Tasks submitted here never wait on other tasks
of the same pool (no nesting), so sharing cannot deadlock.

Hashing has pools of its own (`executor(n, "hash")`): a read task hands its bytes to a
hash task and goes on reading, and a save hashes what it writes there while the writes
stay in flight, so the disk and the cores work at once (a thread that read, then hashed,
left the disk idle while it hashed, and the threads fell into step: read together, then
hash together). A read task may wait for a buffer that only a hash task frees; hash tasks
never wait on I/O tasks, so that cannot deadlock.
"""

from __future__ import annotations

import atexit
import collections
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}


def executor(threads: int, kind: str = "io") -> ThreadPoolExecutor:
    """The shared pool of `kind` ("io", "hash") with `threads` workers (made on first use)."""
    threads = max(1, int(threads))
    with _lock:
        pool = _pools.get((kind, threads))
        if pool is None:
            pool = _pools[(kind, threads)] = ThreadPoolExecutor(
                threads, thread_name_prefix=f"ckpt-{kind}{threads}"
            )
        return pool


def wait_all(futures: Sequence[Future[T]]) -> list[T]:
    """Every result, in order; on a failure the pending tasks are cancelled, the running
    ones are still waited for (they may hold a file descriptor the caller closes next),
    then the first failure is raised."""
    first: BaseException | None = None
    results: list[T] = []
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as e:  # noqa: PERF203 - collect, then raise the first
            if first is None:
                first = e
                for g in futures:
                    g.cancel()
    if first is not None:
        raise first
    return results


class Pipeline:
    """Tasks on a shared pool, at most `limit` in flight, so that tasks added while it runs
    (`urgent`) go before the ones still queued instead of after all of them: a save's
    read-back of a written window runs while later windows are still being written.

    start() sets it going and returns; wait() returns when every task is done (run() is
    both). On a failure, or stop(), no new task starts, the running ones are waited for,
    and wait() raises the first failure.
    """

    def __init__(self, pool: ThreadPoolExecutor, limit: int, tasks: Iterable[Callable[[], None]]):
        self._pool = pool
        self._limit = max(1, limit)
        self._queued: collections.deque[Callable[[], None]] = collections.deque(tasks)
        self._urgent: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._running = 0
        self._error: BaseException | None = None

    @property
    def failed(self) -> bool:
        """Whether a task failed or stop() was called: work feeding this pipeline can stop."""
        return self._error is not None

    def urgent(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._urgent.append(fn)
            self._pump()

    def start(self) -> None:
        with self._cond:
            self._pump()

    def stop(self, error: BaseException) -> None:
        """Start nothing more; wait() raises `error` unless a task failed first."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            while self._running or (self._error is None and (self._urgent or self._queued)):
                self._cond.wait()
            if self._error is not None:
                raise self._error

    def run(self) -> None:
        self.start()
        self.wait()

    def _pump(self) -> None:  # holds the lock
        while self._error is None and self._running < self._limit:
            if self._urgent:
                fn = self._urgent.popleft()
            elif self._queued:
                fn = self._queued.popleft()
            else:
                break
            self._running += 1
            self._pool.submit(self._run, fn)

    def _run(self, fn: Callable[[], None]) -> None:
        error = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to wait()'s caller
            error = e
        with self._cond:
            self._running -= 1
            if error is not None and self._error is None:
                self._error = error
            self._pump()
            self._cond.notify_all()


def _shutdown() -> None:
    with _lock:
        for pool in _pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        _pools.clear()


atexit.register(_shutdown)
