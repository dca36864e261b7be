"""PendingSave: the handle of a save that persists in the background.

`wait()` re-raises a background failure in the caller's thread, once; the Checkpointer
also raises it at the next `save()` and at `close()` unless the user chose
on_error="warn", so a failed save can never pass unnoticed.

The background side calls `settle()` exactly once; everything else is the reader's side.
`join()` waits without raising and `take_unseen_error()` hands a failure over once, so
the Checkpointer decides when to raise without reaching into the handle.
"""

from __future__ import annotations

import dataclasses
import threading

from ckpt._results import SaveResult


@dataclasses.dataclass
class SaveTimings:
    blocking_s: float = 0.0  # what the training loop waited for (flatten + staging)
    staging_s: float = 0.0  # the copy into host memory
    image_wait_s: float = 0.0  # of staging_s, the wait for the staging buffer to be mapped
    gc_s: float = 0.0  # of blocking_s, Python's garbage collector (ckpt._gcclock)
    persist_s: float = 0.0  # hashing, planning, writing, verifying (background)
    commit_s: float = 0.0  # from this rank's report to COMMITTED


class PendingSave:
    def __init__(self, step: int, *, skipped: bool = False):
        self.step = step
        self.skipped = skipped
        self.timings = SaveTimings()
        self.bytes = 0
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._error_seen = False
        if skipped:
            self._done.set()

    # -- the background side -------------------------------------------------------------
    def settle(self, result: SaveResult | None, error: BaseException | None) -> None:
        """Record the outcome (once): the result when committed, else the failure."""
        if self._done.is_set():
            raise RuntimeError(f"step {self.step}: the save's outcome was already recorded")
        self._result, self._error = result, error
        self._done.set()

    # -- the reader's side ---------------------------------------------------------------
    def done(self) -> bool:
        return self._done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the save has committed or failed, without raising; False on timeout."""
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """The SaveResult once committed (None for a skipped save); raises the failure."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"step {self.step}: the save is still persisting after {timeout} s")
        if self._error is not None:
            self._error_seen = True
            raise self._error
        return self._result

    @property
    def result(self) -> SaveResult | None:
        return self.wait()

    @property
    def committed(self) -> SaveResult | None:
        """The SaveResult when the save is done and committed, else None (never raises)."""
        return self._result if self._done.is_set() else None

    @property
    def error(self) -> BaseException | None:
        """The failure once the save is done (None while persisting or when committed)."""
        return self._error if self._done.is_set() else None

    @property
    def failed(self) -> bool:
        return self._done.is_set() and self._error is not None

    def take_unseen_error(self) -> BaseException | None:
        """The failure if nobody has seen it yet, and marks it seen; else None."""
        if self._done.is_set() and self._error is not None and not self._error_seen:
            self._error_seen = True
            return self._error
        return None

    @property
    def blocking_s(self) -> float:
        return self.timings.blocking_s

    @property
    def staging_s(self) -> float:
        return self.timings.staging_s

    @property
    def persist_s(self) -> float:
        return self.timings.persist_s

    @property
    def commit_s(self) -> float:
        return self.timings.commit_s

    @property
    def gbps(self) -> float:
        total = self.timings.blocking_s + self.timings.persist_s + self.timings.commit_s
        return self.bytes / total / 1e9 if total else 0.0

    def __repr__(self) -> str:
        state = (
            "skipped"
            if self.skipped
            else ("failed" if self.failed else ("done" if self.done() else "persisting"))
        )
        return f"PendingSave(step={self.step}, {state}, blocking={self.blocking_s * 1e3:.0f} ms)"
