"""How long Python's garbage collector ran while a block of code ran.

A full collection (generation 2) walks every container object of the process: about
180,000 in a process that imported torch, 90 ms when hot and 120-160 ms after a save's
copy has flushed the caches on the 2-core VM (bench/README.md, issue 16 sixteenth pass).
It falls due after enough allocations, and whichever code allocates then pays for it: a
save's flatten, sometimes. Every collection holds the GIL, so one in any thread stalled
the caller too. A save reports the seconds of its blocking part that were collections
(SaveResult.gc_s), so a stall that grew for this reason says so; docs/configuration.md
has what a training script can do about it (gc.freeze() once the model is built).
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcClock:
    """`with GcClock() as c: ...`; then c.s: the seconds collections ran inside the block
    (any thread's). The callback is registered only while the block runs."""

    def __init__(self) -> None:
        self.s = 0.0
        self._start = 0.0

    def _tick(self, phase: str, info: dict[str, Any]) -> None:
        # A collection holds the GIL from "start" to "stop": the pairs never interleave.
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start:
            self.s += time.perf_counter() - self._start
            self._start = 0.0

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._tick)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._tick)
