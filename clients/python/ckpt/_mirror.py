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

Every rank uploads its own shard (and index), reads it back from the mirror and marks
it verified there; rank 0 writes the mirror's manifest once every rank's mark is there
(ckptd.format.mirror), records the tier in the catalog and runs the mirror's retention.
No rank reads another's files, so the local tier may be each node's own disk. Rank 0
waits `commit_wait_s` for the others' marks, and gives up sooner when a newer step is
pending (the ranks skip steps independently: the newer one replaces it everywhere).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptd.coordinator import retention
from ckptd.errors import CheckpointNotFound, CkptError, MirrorIncomplete, ShardMissing
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.format.mirror import MirrorResult, commit_copy, copy_shards
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
        rank: int = 0,
        world_size: int = 1,
        commit_wait_s: float = 600.0,
    ):
        self.source, self.mirror, self.job = source, mirror, job
        self.rank, self.world_size, self.commit_wait_s = rank, world_size, commit_wait_s
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
        who = f" rank {self.rank}" if self.world_size > 1 else ""
        where = f"job {self.job} step {step}{who} -> mirror {self.mirror.url}"
        self._note(step, "UPLOADING", "")
        error = ""
        for attempt in range(1, self.retries + 1):
            try:
                res = self._copy(step)
            except MirrorIncomplete as e:
                error = f"{type(e).__name__}: {e}"
                break  # waited already; the next step is copied in its place
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

    def _copy(self, step: int) -> MirrorResult:
        """This rank's shard (every shard in a one-rank job), then rank 0 commits."""
        ranks = None if self.world_size == 1 else {self.rank}
        replacing = ckfmt.quarantine_reason(self.mirror, step) is not None
        if replacing and self.rank == 0:
            # The mirror's copy of this step failed verification (resume fell back past it):
            # the newer save of the step takes its place there too (retention.make_way).
            # Rank 0 removes it, before its own commit of the new copy there; the other
            # ranks upload meanwhile. Files of the new copy are never removed.
            m = ckfmt.read_manifest(self.source, step)
            new = {p for sh in m.shards for p in (sh.path, sh.index)}
            where = f"job {self.job} step {step} in mirror {self.mirror.url}"
            retention.make_way(self.mirror, step, where=where, spare=new)
        res = copy_shards(
            self.source, self.mirror, step, job=self.job, ranks=ranks, replacing=replacing
        )
        if self.rank == 0 and not res.already_there:
            commit_copy(
                self.source,
                self.mirror,
                step,
                job=self.job,
                wait_s=self.commit_wait_s,
                give_up=lambda: self._pending is not None,
            )
        return res

    def _retention(self) -> None:
        if self.keep_last is None or self.rank != 0:
            return
        try:
            removed = retention.apply(self.mirror, self.keep_last)
        except (CkptError, OSError) as e:
            log.warning("job %s: retention in mirror %s failed: %s", self.job, self.mirror.url, e)
            return
        for step in removed:
            self._note(step, "REMOVED", "")

    def _note(self, step: int, status: str, reason: str) -> None:
        if self._record is None or self.rank != 0:  # the step's copy is rank 0's to record
            return
        try:
            self._record(step, status, reason)
        except Exception as e:  # noqa: BLE001 - the catalog is a view; the copy stands
            log.warning(
                "job %s step %d: could not record mirror status %s: %s", self.job, step, status, e
            )


def _still_committed(storage: Storage, step: int) -> bool:
    return storage.exists(f"{layout.step_dir(step)}/{layout.MANIFEST_NAME}")
