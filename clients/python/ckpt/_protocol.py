"""The commit protocol, client side: BeginSave -> write -> ReportShard -> AwaitCommit.

Every save that reaches the coordinator follows these steps, whoever runs them: the
Checkpointer on each rank, or the DCP and Lightning integrations on behalf of every rank
of a save from one process. `RankSave` is one rank's side of one save:

    save = RankSave(client, ref, timeout_s=...)
    begun = save.begin(plan, ...)          # waits at the coordinator's barrier for all ranks
    with save.leased(begun.lease_s):       # keep-alives while the shard is written
        ...write, fsync, verify the shard...
        status = save.commit(report)       # ReportShard, then AwaitCommit
    save.require_committed(status)

A failure on this side aborts the save for every rank (the others must not wait for this
one at the barrier or for its report); the abort is quiet, since the failure that caused
it is what the caller raises. A rank whose write fails because the coordinator aborted the
save under it (an abort removes the save's files) raises SaveAborted with the
coordinator's reason, its own storage error chained: the cause, not the symptom.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd.coordinator.planning import ChunkPlan
from ckptd.coordinator.types import BeginResult, SaveRef, ShardReport, StatusResult
from ckptd.errors import CkptError, CoordinatorUnavailable, SaveAborted, SaveFailed
from ckptd.faults import crash_point
from ckptd.server.client import CoordinatorClient
from ckptd.server.errors import aborted_by

log = logging.getLogger("ckpt")


class RankSave:
    """One rank's side of one save: the calls it makes to the coordinator, in order."""

    def __init__(self, client: CoordinatorClient, ref: SaveRef, *, timeout_s: float):
        self.client, self.ref, self.timeout_s = client, ref, timeout_s
        self.where = f"job {ref.job!r} step {ref.step} rank {ref.rank}/{ref.world_size}"

    def begin(
        self,
        plan: Sequence[ChunkPlan],
        *,
        state: Any,
        metadata: dict[str, Any],
        allow_divergent: bool,
        keep_last: int | None,
        parent: int | None = None,
    ) -> BeginResult:
        """BeginSave with this rank's plan: waits until every rank has joined, then says
        which of the chunks this rank writes (replicas are written once) and its shard.
        parent: the step this state descends from (recorded in the manifest)."""
        t0 = time.perf_counter()
        try:
            begun = self.client.begin_save(
                self.ref,
                list(plan),
                state=state,
                metadata=metadata,
                allow_divergent=allow_divergent,
                keep_last=keep_last or 0,
                timeout_s=self.timeout_s,
                parent=parent,
            )
        except BaseException as e:
            if not isinstance(e, CkptError):  # a CkptError is the coordinator's own answer
                self.abort(f"{type(e).__name__}: {e}")
            raise
        for w in begun.warnings:
            log.warning("%s: %s", self.where, w)
        log.debug(
            "%s: planned %d chunk(s), writes %d (%s) after %.3f s at the barrier",
            self.where,
            len(plan),
            len(begun.write),
            begun.shard_path,
            time.perf_counter() - t0,
        )
        return begun

    @contextlib.contextmanager
    def leased(self, lease_s: float) -> Iterator[None]:
        """Renew this rank's lease while the body runs (writing, verifying, reporting).

        A failure in the body aborts the save for every rank, or, when the coordinator had
        already aborted it, becomes the coordinator's SaveAborted (the cause)."""
        stop = threading.Event()
        pinger = threading.Thread(target=self._keep_alive, args=(lease_s, stop), daemon=True)
        pinger.start()
        try:
            yield
        except BaseException as e:
            stop.set()
            aborted = self._aborted_under(e)
            if aborted is not None:
                raise aborted from e
            self.abort(f"{type(e).__name__}: {e}")
            raise
        finally:
            stop.set()

    def report(self, report: ShardReport) -> StatusResult:
        """ReportShard: the coordinator stats the shard and records it."""
        return self.client.report_shard(self.ref, report)

    def await_commit(self) -> StatusResult:
        """AwaitCommit: COMMITTED once every rank's shard is recorded, or ABORTED."""
        return self.client.await_commit(self.ref, self.timeout_s)

    def commit(self, report: ShardReport) -> StatusResult:
        """Report this rank's shard, then wait for the save's outcome."""
        crash_point("rank.before_report")
        status = self.report(report)
        crash_point("rank.after_report")
        if status.status != "ABORTED":
            status = self.await_commit()
        return status

    def require_committed(self, status: StatusResult, detail: str = "") -> None:
        """Raise unless `status` is COMMITTED: SaveAborted, or the error the coordinator
        named as the cause (a StorageError when its disk was full for the manifest)."""
        if status.status != "COMMITTED":
            raise aborted_by(status.error)(
                f"{self.where}: the save was not committed ({status.status}{detail}): "
                f"{status.reason}. Nothing was committed; earlier checkpoints are untouched"
            )

    def abort(self, reason: str) -> None:
        """Abort the save for every rank; a failure to say so is logged, not raised (the
        caller raises the failure that caused the abort; the lease expires in any case)."""
        try:
            self.client.abort_save(self.ref, reason)
        except CkptError as e:
            log.warning(
                "%s: could not tell the coordinator that the save failed: %s", self.where, e
            )

    def _keep_alive(self, lease_s: float, stop: threading.Event) -> None:
        while not stop.wait(max(0.05, lease_s / 3)):
            try:
                st = self.client.keep_alive(self.ref)
            except CkptError as e:
                log.debug("%s: keep-alive failed: %s", self.where, e)
                continue
            if st.status in ("ABORTED", "COMMITTED"):
                return

    def _aborted_under(self, e: BaseException) -> CkptError | None:
        """The coordinator's error when it had already aborted the save, else None.

        An abort removes the save's files, so a rank still writing or verifying then fails
        on storage (ShardMissing, ...): a symptom. The save's state names the cause (a
        peer's lease expired, a newer attempt fenced this one). While the save is open, or
        when the coordinator cannot be asked, the rank's own error stands.
        """
        if not isinstance(e, Exception) or isinstance(e, (SaveFailed, CoordinatorUnavailable)):
            return None  # already the coordinator's word, or it cannot be asked
        try:
            st = self.client.keep_alive(self.ref)
        except SaveFailed as fenced:  # StaleGeneration: this attempt is superseded
            return fenced
        except CkptError as q:
            log.debug("%s: could not ask the coordinator why the save failed: %s", self.where, q)
            return None
        if st.status != "ABORTED":
            return None
        return SaveAborted(
            f"{self.where}: the coordinator aborted the save while this rank was writing its "
            f"shard ({st.reason}); this rank's {type(e).__name__} follows from it (an aborted "
            "save's files are removed). Earlier checkpoints are intact; the next save proceeds "
            "as usual"
        )


def commit_for_ranks(
    client: CoordinatorClient,
    refs: Sequence[SaveRef],
    plans: Sequence[Sequence[ChunkPlan]],
    reports: Sequence[ShardReport],
    *,
    state: Any,
    metadata: dict[str, Any],
    keep_last: int | None,
    timeout_s: float,
) -> None:
    """The protocol on behalf of every rank of a save whose shards are already written.

    DCP gathers every rank's write results to one rank, and Lightning saves from rank 0:
    one process runs each rank's BeginSave (in threads: they meet at the coordinator's
    barrier), checks that every chunk stays where it was written, reports every shard and
    awaits the commit. Any failure aborts the save.
    """
    saves = [RankSave(client, ref, timeout_s=timeout_s) for ref in refs]
    statuses: list[str] = []

    def begin(i: int) -> list[int]:
        return (
            saves[i]
            .begin(
                plans[i], state=state, metadata=metadata, allow_divergent=False, keep_last=keep_last
            )
            .write
        )

    try:
        with ThreadPoolExecutor(len(saves)) as pool:
            writes = list(pool.map(begin, range(len(saves))))
            for s, w, plan in zip(saves, writes, plans, strict=True):
                if w != list(range(len(plan))):
                    raise SaveAborted(
                        f"{s.where}: the coordinator assigned chunks {w[:8]} of {len(plan)}; "
                        "the shards already hold every chunk once, so each must be kept (did "
                        "two ranks write the same chunk?)"
                    )
            answers = pool.map(lambda i: saves[i].report(reports[i]), range(len(saves)))
            statuses = [st.status for st in answers]
        status = saves[0].await_commit()
    except BaseException as e:
        saves[0].abort(f"{type(e).__name__}: {e}")
        raise
    saves[0].require_committed(status, f"; reports {sorted(set(statuses))}")


class MemoryRankSave:
    """One rank's side of one memory save (ckptd.coordinator.memory): the same shape as
    RankSave, over the MemorySave RPC.

        save = MemoryRankSave(client, ref, timeout_s=...)
        save.join()                       # the save is open at the coordinator
        with save.leased():               # "alive" while the shard is placed
            ...write the shard into the node's memory, agents verify and copy it...
            manifest = save.commit(report)  # "held", then "await": COMMITTED or raises

    A failure in the body aborts the memory save for every rank (quietly: the caller
    reports the failure); the coordinator is the one that commits.
    """

    def __init__(self, client: CoordinatorClient, ref: SaveRef, *, timeout_s: float):
        self.client, self.ref, self.timeout_s = client, ref, timeout_s
        self.where = f"job {ref.job!r} step {ref.step} rank {ref.rank}/{ref.world_size} (memory)"

    def join(self) -> None:
        status, _ = self.client.memory_save(self.ref, "join", timeout_s=self.timeout_s)
        self._require_open(status)

    @contextlib.contextmanager
    def leased(self) -> Iterator[None]:
        stop = threading.Event()
        lease_s = self.client.lease_s or 20.0
        pinger = threading.Thread(target=self._keep_alive, args=(lease_s, stop), daemon=True)
        pinger.start()
        try:
            yield
        except BaseException as e:
            stop.set()
            if not isinstance(e, SaveAborted):  # SaveAborted: the coordinator's own word
                self.abort(f"{type(e).__name__}: {e}")
            raise
        finally:
            stop.set()

    def commit(self, report: dict[str, Any]) -> bytes:
        """Report where this rank's shard is held, then wait for the decision; returns the
        step's manifest once the coordinator committed it."""
        status, manifest = self.client.memory_save(self.ref, "held", report)
        deadline = time.monotonic() + self.timeout_s
        while status.status == "OPEN" and time.monotonic() < deadline:
            wait = min(max(1.0, (self.client.lease_s or 20.0) / 2), 30.0)
            status, manifest = self.client.memory_save(self.ref, "await", timeout_s=wait)
        if status.status != "COMMITTED" or not manifest:
            raise SaveAborted(
                f"{self.where}: the memory checkpoint was not committed ({status.status}"
                f"{', its manifest lost' if status.status == 'COMMITTED' else ''}): "
                f"{status.reason or 'no decision within the timeout'}"
            )
        return manifest

    def abort(self, reason: str) -> None:
        try:
            self.client.memory_save(self.ref, "abort", reason=reason)
        except CkptError as e:
            log.warning(
                "%s: could not tell the coordinator the memory save failed: %s", self.where, e
            )

    def _require_open(self, status: StatusResult) -> None:
        if status.status != "OPEN":
            raise SaveAborted(f"{self.where}: {status.status}: {status.reason}")

    def _keep_alive(self, lease_s: float, stop: threading.Event) -> None:
        while not stop.wait(max(0.05, lease_s / 3)):
            try:
                status, _ = self.client.memory_save(self.ref, "alive")
            except CkptError as e:
                log.debug("%s: keep-alive failed: %s", self.where, e)
                continue
            if status.status != "OPEN":
                return
