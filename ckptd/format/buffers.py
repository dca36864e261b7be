"""Page-aligned, huge-page advised buffers kept for the life of the process.

A fresh buffer's first O_DIRECT transfer pays for faulting in and pinning every page (see
ckptd.iopool and ckptd.storage.local.map_populated), so the windows of loads and saves go
through buffers taken from a pool and given back, never mapped per window. Reads and
the staged writes of a save each have a pool of their own (READS: loads, verifies and a
save's early read-back; WRITES: writer._Staged), so that a save's writes never wait for
buffers a load holds. Buffers are taken by the caller's thread or a reading task and given
back by the task that consumes them, which never waits on anything itself.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

import numpy as np

from ckptd import knobs
from ckptd.storage.local import ALIGN, map_populated


class Buffers:
    """Buffers of at least `least()` bytes. take() hands one out, waiting while `limit`
    are out; give() takes it back, from any thread."""

    def __init__(self, least: Callable[[], int]) -> None:
        self._least = least
        self._cond = threading.Condition()
        self._free: list[np.ndarray] = []
        self._maps: dict[int, tuple[np.ndarray, mmap.mmap]] = {}  # by address, given out
        self._out = 0
        self.probe = np.frombuffer(mmap.mmap(-1, ALIGN), dtype=np.uint8)  # can_read_into

    @property
    def out(self) -> int:
        """How many are handed out now."""
        with self._cond:
            return self._out

    def take(self, n: int, limit: int) -> np.ndarray:
        """A buffer's first `n` bytes."""
        buf = self._take(n, limit, None)
        assert buf is not None
        return buf

    def take_unless(self, n: int, limit: int, give_up: Callable[[], bool]) -> np.ndarray | None:
        """As take(); None once `give_up()` is true while waiting for one (the work that
        would have given one back has stopped)."""
        return self._take(n, limit, give_up)

    def _take(self, n: int, limit: int, give_up: Callable[[], bool] | None) -> np.ndarray | None:
        with self._cond:
            while True:
                fits = [b for b in self._free if b.nbytes >= n]
                if fits:
                    buf = min(fits, key=lambda b: b.nbytes)
                    # By identity: list.remove would compare arrays element by element.
                    self._free = [b for b in self._free if b is not buf]
                    self._out += 1
                    return buf[:n]
                if self._free or self._out < limit:
                    if self._free:  # every free one is too small: replace one
                        del self._maps[address(self._free.pop())]
                    self._out += 1
                    break
                if give_up is None:
                    self._cond.wait()
                elif give_up() or not self._cond.wait(0.05) and give_up():
                    return None
        try:
            size = -(-max(n, self._least()) // ALIGN) * ALIGN
            mm, buf = map_populated(size)
        except BaseException:
            with self._cond:
                self._out -= 1
                self._cond.notify()
            raise
        with self._cond:
            self._maps[address(buf)] = (buf, mm)
        return buf[:n]

    def give(self, view: np.ndarray) -> None:
        with self._cond:
            buf, _ = self._maps[address(view)]
            self._free.append(buf)
            self._out -= 1
            self._cond.notify()


def address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


# A read window and the part of a page before it (reads start where their bytes lie in a
# page: reader.read_window's phase).
READS = Buffers(lambda: knobs.get().read_window + ALIGN)
# A write window (writer._Staged).
WRITES = Buffers(lambda: knobs.get().io_window)
