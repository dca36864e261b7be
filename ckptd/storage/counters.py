"""Bytes that reached storage, counted where they do: the process's I/O ledger.

Every backend adds to it at the call that moves bytes to or from the store: a local
pwrite/pread (what the device was asked for, padding and O_DIRECT rounding included), an
object PUT or ranged GET (the body's length). Benchmarks and tests read it to say how many
bytes a save wrote or a load read, instead of what the code above thought it sent; one
process is one rank, so a multi-rank figure is the sum of the ranks' ledgers.
"""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class IOCounts:
    read_bytes: int = 0  # tensor-data reads (shard files)
    read_calls: int = 0
    written_bytes: int = 0  # positional writes and uploads of shard files
    write_calls: int = 0
    small_read_bytes: int = 0  # whole small files: manifests, indexes, markers
    small_written_bytes: int = 0

    def __sub__(self, other: IOCounts) -> IOCounts:
        return IOCounts(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(IOCounts))
        )


class _Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = IOCounts()

    def add(self, **delta: int) -> None:
        with self._lock:
            c = self._counts
            self._counts = dataclasses.replace(
                c, **{k: getattr(c, k) + v for k, v in delta.items()}
            )

    def snapshot(self) -> IOCounts:
        with self._lock:
            return self._counts


LEDGER = _Ledger()


def snapshot() -> IOCounts:
    """What this process has read from and written to storage so far."""
    return LEDGER.snapshot()


def read(n: int) -> None:
    LEDGER.add(read_bytes=n, read_calls=1)


def wrote(n: int) -> None:
    LEDGER.add(written_bytes=n, write_calls=1)


def read_small(n: int) -> None:
    LEDGER.add(small_read_bytes=n)


def wrote_small(n: int) -> None:
    LEDGER.add(small_written_bytes=n)
