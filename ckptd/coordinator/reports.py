"""Shard reports: a rank's (ReportShard) or a node's batch of them (ReportShardsNode).

One save's reports go through three steps, the same for one rank or a node's batch: each
rank's own checks (`_admit_report`: fencing, the save still open, a retry of a report
already accepted, the assigned names), then a worker-thread call that looks at every new
shard on storage (session.check_reports: size, index blake3, the assigned chunks; the
calls of batches that arrive together coalesced: ReportChecks), then one
catalog transaction for their rows, durable before any rank hears it was accepted. The
last report starts the commit. Mixed into the Coordinator, which provides what is declared
below.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ckptd.coordinator import observer as obs
from ckptd.coordinator.catalog import Catalog
from ckptd.coordinator.session import Session, check_reports
from ckptd.coordinator.types import ABORTED, COMMITTING, OPEN, SaveRef, ShardReport, StatusResult
from ckptd.errors import CkptError, InvalidRequest, SaveAborted, StaleGeneration
from ckptd.faults import crash_point
from ckptd.format import layout
from ckptd.storage import Storage

# Worker calls that check reports at once. More would only queue for the GIL (the checks
# are mostly parsing); fewer would leave a slow filesystem's stat and read latency unhidden.
CHECK_WORKERS = 4


class ReportChecks:
    """Storage checks of the reports that arrive together, coalesced: a node batch's
    checks queue while CHECK_WORKERS worker calls are busy, and the next free worker takes
    every queued batch in one call (session.check_reports). 512 nodes reporting at once
    make a few thread hops, not 512: each hop costs the event loop a submit and a wake-up."""

    def __init__(self) -> None:
        self._queued: list[tuple[list[Any], asyncio.Future[list[CkptError | None]]]] = []
        self._busy = 0
        self._workers: set[asyncio.Task[None]] = set()  # held: the loop keeps tasks weakly

    async def check(
        self, checks: list[tuple[Session, Storage, int, ShardReport]]
    ) -> list[CkptError | None]:
        """The error of each check that fails, else None (as session.check_reports)."""
        fut: asyncio.Future[list[CkptError | None]] = asyncio.get_running_loop().create_future()
        self._queued.append((checks, fut))
        if self._busy < CHECK_WORKERS:
            self._busy += 1
            task = asyncio.get_running_loop().create_task(self._drain())
            self._workers.add(task)
            task.add_done_callback(self._workers.discard)
        return await fut

    async def _drain(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                try:
                    got = await asyncio.to_thread(check_reports, [c for cs, _ in batch for c in cs])
                except BaseException as e:  # each waiter hears it, never a hang
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
                    continue
                at = 0
                for cs, fut in batch:
                    if not fut.done():  # a waiter cancelled (its RPC ended) takes nothing
                        fut.set_result(got[at : at + len(cs)])
                    at += len(cs)
        finally:
            self._busy -= 1


class Reports:
    """ReportShard for one rank or a node's batch, mixed into the Coordinator."""

    catalog: Catalog
    report_checks: ReportChecks
    observer: obs.SaveObserver

    def job_name(self, job: str) -> str:
        raise NotImplementedError

    async def _commit(self, s: Session) -> None:
        raise NotImplementedError

    def _check_ref(self, ref: SaveRef) -> str:
        raise NotImplementedError

    def _ended(self, ref: SaveRef, job: str) -> StatusResult | None:
        raise NotImplementedError

    def _session(self, ref: SaveRef, job: str) -> Session:
        raise NotImplementedError

    def _spawn(self, coro: Any) -> None:
        raise NotImplementedError

    def storage(self, job: str) -> Storage:
        raise NotImplementedError

    def _remove_files(
        self, job: str, step: int, generation: int, ranks: Iterable[int], idle: bool = False
    ) -> None:
        raise NotImplementedError

    async def _abort(
        self,
        s: Session,
        reason: str,
        kind: type[CkptError] = SaveAborted,
        outcome: str = obs.ABORTED,
        asked_by_sole_rank: bool = False,
    ) -> None:
        raise NotImplementedError

    async def report_shard(
        self, ref: SaveRef, report: ShardReport, node: str | None = None
    ) -> StatusResult:
        (answer,) = await self.report_shards([(ref, report)], node)
        if isinstance(answer, CkptError):
            raise answer
        return answer

    async def report_shards(
        self, reports: Sequence[tuple[SaveRef, ShardReport]], node: str | None = None
    ) -> list[StatusResult | CkptError]:
        """Shard reports of one save (one rank's, or a node's batch): each rank's own
        checks, then one worker call that looks at every new shard on storage
        (Session.check_reports), then one catalog transaction for their rows; the answer
        (or the error) of each report in order. The commit starts once the last is in."""
        out: list[StatusResult | CkptError | None] = [None] * len(reports)
        todo: list[tuple[int, Session, str, SaveRef, ShardReport]] = []
        for i, (ref, report) in enumerate(reports):
            try:
                got = self._admit_report(ref, report, node)
            except CkptError as e:
                out[i] = e
                continue
            if isinstance(got, StatusResult):
                out[i] = got
            else:
                todo.append((i, got[0], got[1], ref, report))
        if todo:
            checks = [(s, self.storage(job), ref.rank, rep) for _, s, job, ref, rep in todo]
            failed = await self.report_checks.check(checks)
            accepted = []
            for (i, s, job, ref, _), bad in zip(todo, failed, strict=True):
                if bad is None:
                    accepted.append((i, s, job, ref))
                    continue
                why = f"rank {ref.rank}: {bad}"
                self.observer.verification_failed(job, ref.step, "report", why)
                await self._abort(s, why, outcome=obs.FAILED)
                out[i] = StatusResult(ABORTED, s.reason)
            if node is not None:
                crash_point("coordinator.mid_node_reports")  # checked, no row durable yet
            rows = [
                (s.job, s.step, s.generation, ref.rank, reports[i][1]) for i, s, _, ref in accepted
            ]
            try:
                await self.catalog.record_reports(rows)
            except CkptError as e:
                for i, *_ in accepted:
                    out[i] = e
                accepted = []
            for i, s, job, ref in accepted:
                out[i] = self._accept_report(s, job, ref, reports[i][1])
        return [x for x in out if x is not None]

    def _admit_report(
        self, ref: SaveRef, report: ShardReport, node: str | None
    ) -> StatusResult | tuple[Session, str]:
        """A report's checks before storage is looked at: the answer now (a save that
        ended, a retry of an accepted report), or the session and job to check it in."""
        try:
            job = self._check_ref(ref)
        except StaleGeneration:
            # The fenced rank wrote files of its own generation; they are nobody's now.
            name = self.job_name(ref.job)
            self._spawn(
                asyncio.to_thread(self._remove_files, name, ref.step, ref.generation, [ref.rank])
            )
            raise
        ended = self._ended(ref, job)
        if ended is None:
            s = self._session(ref, job)
            if s.status == ABORTED:
                ended = StatusResult(ABORTED, s.reason)
        if ended is not None:
            if ended.status == ABORTED:
                # A rank that finished writing after the abort removed the save's files
                # (a slow rank while another's lease expired): its files are debris now.
                self._spawn(
                    asyncio.to_thread(self._remove_files, job, ref.step, ref.generation, [ref.rank])
                )
            return ended
        where = f"job {job!r} step {ref.step} rank {ref.rank}"
        if s.assignment is None:
            raise InvalidRequest(f"{where}: ReportShard before the plan was made")
        s.speaks_for(ref.rank, node)
        prev = s.reports.get(ref.rank)
        if prev is not None:
            if prev == report:
                return s.answer()
            raise InvalidRequest(
                f"{where}: shard reported twice with different contents (index blake3 "
                f"{prev.index_blake3[:12]} then {report.index_blake3[:12]})"
            )
        if s.status != OPEN:
            return s.answer()
        want_shard, want_index = (
            layout.shard_name(ref.rank, s.generation),
            layout.index_name(ref.rank, s.generation),
        )
        if report.shard_path != want_shard or report.index_path != want_index:
            raise InvalidRequest(
                f"{where}: reported {report.shard_path!r}, assigned {want_shard!r}"
            )
        if report.verify not in ("full", "size"):
            raise InvalidRequest(f"{where}: verify must be full or size")
        return s, job

    def _accept_report(
        self, s: Session, job: str, ref: SaveRef, report: ShardReport
    ) -> StatusResult:
        """A checked report whose row is durable: the rank is in; the last one commits."""
        if s.status != OPEN:  # aborted while we checked
            return StatusResult(s.status, s.reason)
        s.reports[ref.rank] = report
        s.bytes += report.size
        self.observer.shard_reported(job, ref.step, ref.rank, report)
        if len(s.reports) == s.world_size and s.commit_task is None:
            s.status = COMMITTING
            s.all_reported = time.monotonic()
            s.commit_task = asyncio.get_running_loop().create_task(self._commit(s))
        return s.answer()
