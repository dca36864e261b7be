"""The mirror tier: committed steps copied to a second store in the background.

    commit on the job's directory (the fast local tier)  -> training is released
    submit(step) -> a background thread: UPLOADING -> copy, read back, verify -> manifest
        -> HELD (recorded) -> retention in the mirror (mirror_keep_last) -> REMOVED rows

A new Checkpointer submits the newest local step at start, so a copy that a killed
or disconnected run left unfinished is redone (a mirror that holds it already is only
checked). The copy never blocks a save: one thread, one pending step, newest wins (a step
committed while an older one waits replaces it, so a slow or down mirror falls behind
by skipping steps, never by queueing memory or holding the local tier). A failed copy
is retried `retries` times with backoff, then logged as an error and recorded FAILED;
the next commit tries again with its own step. The step's files are read from the
local tier while they upload: if local retention removed the step first (mirror far
behind, keep_last small), that step is skipped with a warning.

One process uploads (rank 0), reading every rank's shard from the job's directory, so
the local tier must be readable by rank 0 (one node, or a shared filesystem).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptd.coordinator import retention
from ckptd.errors import CheckpointNotFound, CkptError, ShardMissing
from ckptd.format import layout
from ckptd.format.mirror import MirrorResult, mirror_step
from ckptd.storage.base import Storage

log = logging.getLogger("ckpt")

Recorder = Callable[[int, str, str], None]  # (step, status, reason)


class MirrorUploader:
    def __init__(
        self,
        source: Storage,
        mirror: Storage,
        *,
        job: str,
        keep_last: int | None = None,
        retries: int = 3,
        backoff_s: float = 1.0,
        record: Recorder | None = None,
    ):
        self.source, self.mirror, self.job = source, mirror, job
        self.keep_last = keep_last
        self.retries, self.backoff_s = retries, backoff_s
        self._record = record
        self._cv = threading.Condition()
        self._pending: int | None = None
        self._busy = False
        self._closing = False
        self.results: dict[int, MirrorResult] = {}
        self.failures: dict[int, str] = {}
        self.skipped: list[int] = []
        self._thread = threading.Thread(target=self._run, name="ckpt-mirror", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        with self._cv:
            if self._pending is not None and self._pending != step:
                log.warning(
                    "job %s: mirror %s is behind; step %d is skipped there (step %d replaces it)",
                    self.job,
                    self.mirror.url,
                    self._pending,
                    step,
                )
                self.skipped.append(self._pending)
            self._pending = step
            self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing is pending or uploading; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Finish the copy in flight and the pending one (bounded by `timeout`), then stop."""
        if not self.wait(timeout):
            log.error(
                "job %s: the upload to mirror %s did not finish within %s s; it is abandoned "
                "(the mirror keeps what it committed before; nothing half-copied is committed)",
                self.job,
                self.mirror.url,
                timeout,
            )
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closing:
                    self._cv.wait()
                if self._pending is None:
                    return
                step, self._pending, self._busy = self._pending, None, True
            try:
                self._upload(step)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _upload(self, step: int) -> None:
        where = f"job {self.job} step {step} -> mirror {self.mirror.url}"
        self._note(step, "UPLOADING", "")
        error = ""
        for attempt in range(1, self.retries + 1):
            try:
                res = mirror_step(self.source, self.mirror, step, job=self.job)
            except (CheckpointNotFound, ShardMissing) as e:
                if not _still_committed(self.source, step):
                    log.warning(
                        "%s: skipped, the step left the local tier before its upload "
                        "(keep_last is smaller than the mirror's lag): %s",
                        where,
                        e,
                    )
                    self._note(step, "REMOVED", "")
                    self.skipped.append(step)
                    return
                error = f"{type(e).__name__}: {e}"
            except (CkptError, OSError) as e:
                error = f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - a store client's own error: report it
                error = f"{type(e).__name__}: {e}"
            else:
                self.results[step] = res
                self.failures.pop(step, None)
                self._note(step, "HELD", "")
                log.info(
                    "%s: %s (%.1f MB uploaded in %.2f s, read back and verified in %.2f s)",
                    where,
                    "already there" if res.already_there else "mirrored",
                    res.bytes / 1e6,
                    res.upload_s,
                    res.verify_s,
                )
                self._retention()
                return
            log.warning("%s: attempt %d of %d failed: %s", where, attempt, self.retries, error)
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
        self.failures[step] = error
        self._note(step, "FAILED", error)
        log.error(
            "%s: upload FAILED after %d attempts (%s). Training goes on and the local "
            "checkpoint is intact; the next commit retries with its own step. Check the "
            "mirror's endpoint and credentials",
            where,
            self.retries,
            error,
        )

    def _retention(self) -> None:
        if self.keep_last is None:
            return
        try:
            removed = retention.apply(self.mirror, self.keep_last)
        except (CkptError, OSError) as e:
            log.warning("job %s: retention in mirror %s failed: %s", self.job, self.mirror.url, e)
            return
        for step in removed:
            self._note(step, "REMOVED", "")

    def _note(self, step: int, status: str, reason: str) -> None:
        if self._record is None:
            return
        try:
            self._record(step, status, reason)
        except Exception as e:  # noqa: BLE001 - the catalog is a view; the copy stands
            log.warning(
                "job %s step %d: could not record mirror status %s: %s", self.job, step, status, e
            )


def _still_committed(storage: Storage, step: int) -> bool:
    return storage.exists(f"{layout.step_dir(step)}/{layout.MANIFEST_NAME}")
