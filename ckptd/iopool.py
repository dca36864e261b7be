"""Long-lived I/O threads, shared by every save and load of the process.

Each I/O thread keeps its page-aligned bounce buffer (ckptd.storage.local) for its whole
life. Creating threads per save meant fresh buffers per save, and a fresh buffer's first
O_DIRECT transfer pays for faulting and pinning every page: the benchmark measured cold
reads at about half the raw speed that way. Tasks submitted here never wait on other tasks
of the same pool (no nesting), so sharing cannot deadlock.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def executor(threads: int) -> ThreadPoolExecutor:
    """The shared pool with `threads` workers (created on first use)."""
    threads = max(1, int(threads))
    with _lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(
                threads, thread_name_prefix=f"ckpt-io{threads}"
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


def _shutdown() -> None:
    with _lock:
        for pool in _pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        _pools.clear()


atexit.register(_shutdown)
