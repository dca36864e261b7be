"""The coordinator core: save sessions and their commit state machine, without transport.

    OPEN --(all plans in: assignment)--> OPEN, planned
         --(all shards reported, checked)--> COMMITTING --(manifest written)--> COMMITTED
         --(abort, lease expiry, barrier timeout, newer generation)--> ABORTED

One asyncio loop owns all state; blocking storage calls (stat, reading an index, writing
the manifest, removing files) run in threads. The catalog records each transition
durably before it is acknowledged, so a restarted coordinator finishes or aborts what a
previous life left open (`recover`). Fencing: each job has a newest generation; a request
from an older one is refused with StaleGeneration, and a newer one aborts the older's
open saves.

This module is the state machine and the RPCs; around it: the shared types (`types`), one
save's state, manifest and files (`session`), the catalog's writes (`catalog`), start-up
recovery and rebuild (`recovery`), the retention rule (`retention`), who writes what
(`planning`) and what observers hear (`observer`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ckptd.coordinator import layouts, planning, retention
from ckptd.coordinator import observer as obs
from ckptd.coordinator.catalog import Catalog, SaveRecord
from ckptd.coordinator.memory import MemoryCommits, MemorySave
from ckptd.coordinator.nodes import Nodes
from ckptd.coordinator.queries import Queries
from ckptd.coordinator.recovery import Recovery, Skipped
from ckptd.coordinator.reports import ReportChecks, Reports
from ckptd.coordinator.session import (
    STEP_MISMATCH_GRACE_S,
    RankPlan,
    Session,
    manifest_of,
    one_block_size,
    remove_empty_step,
    remove_ranks_files,
    step_mismatch,
    step_mismatch_reason,
)
from ckptd.coordinator.types import (
    ABORTED,
    COMMITTED,
    COMMITTING,
    OPEN,
    BeginResult,
    SaveRef,
    StatusResult,
)
from ckptd.errors import (
    CheckpointExists,
    CkptError,
    InvalidRequest,
    LayoutUnknown,
    SaveAborted,
    StaleGeneration,
    StepMismatch,
    StorageError,
    UnsafePath,
)
from ckptd.faults import crash_point
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, layout
from ckptd.storage import JobLocation, Storage, open_storage

log = logging.getLogger("ckptd.coordinator")

MAX_PLAN_CHUNKS_PER_PART = 20_000
MAX_WORLD_SIZE = layout.MAX_RANK + 1
# Ended saves kept in memory to answer retries whose first reply was lost.
MAX_FINISHED_SAVES = 256
MAX_FINISHED_RANKS = 32_768


class Coordinator(Recovery, Queries, Reports, Nodes, MemoryCommits):
    """Transport-free coordinator over one storage root."""

    def __init__(
        self,
        root: str,
        catalog: Catalog,
        *,
        lease_s: float = 60.0,
        barrier_timeout_s: float = 600.0,
        storage_factory: Callable[[str], Storage] | None = None,
        job: str | None = None,
    ):
        """A coordinator of every job under `root` (`ckptd serve`), or of `job` alone (the
        embedded coordinator of one job): then it rebuilds from that job's directory and
        refuses any other, and never lists, stats or opens a neighbour (promise 6)."""
        self.location = JobLocation.of(root)
        self.root = self.location.path
        self.scope = None if job is None else self.location.job_name(job)
        self.skipped: list[Skipped] = []  # what the start-up scan left out (recovery)
        self.skipped_count = 0
        self.skipped_paths: set[str] = set()
        self.catalog = catalog
        self.lease_s = lease_s
        self.barrier_timeout_s = barrier_timeout_s
        self._storage_factory = storage_factory or (lambda p: open_storage(p, create=True))
        self._default_storage = storage_factory is None
        self.observer: obs.SaveObserver = obs.SaveObserver()  # metrics plug in here
        self._storages: dict[str, Storage] = {}
        self.sessions: dict[tuple[str, int], Session] = {}
        # job -> (step, saved_unix) -> the steps its manifest borrows from (retention).
        self._borrows: dict[str, dict[tuple[int, float], tuple[int, ...]]] = {}
        self.memory_saves: dict[tuple[str, int], MemorySave] = {}  # memory.py
        self.memory_ended: dict[tuple[str, int, int], MemorySave] = {}
        self.layouts = layouts.LayoutCache()  # the ranks' plan layouts, for cached plans
        self.report_checks = ReportChecks()  # storage checks of reports arriving together
        self._watchdog: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._open_lock = asyncio.Lock()
        self._dirs_locks: dict[str, asyncio.Lock] = {}  # _step_dirs_lock
        # Hot-path caches: every RPC names its job and is checked against its generation.
        self._names: dict[str, str] = {}
        self._generations: dict[str, int | None] = {}
        # Sessions that ended recently, so client retries get the same answer.
        self.finished: collections.OrderedDict[tuple[str, int, int], Session] = (
            collections.OrderedDict()
        )

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        await self.recover()
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        """Stop the watchdog, finish background work, and make queued catalog writes durable
        (an abort decided just before shutdown must still be recorded)."""
        if self._watchdog:
            self._watchdog.cancel()
            try:
                await self._watchdog
            except (asyncio.CancelledError, Exception):  # noqa: S110 - stopping
                pass
        for t in list(self._background):
            try:
                await t
            except Exception:  # noqa: S110 - logged where raised
                pass
        await self.catalog.drain()

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    # -- paths -------------------------------------------------------------------------
    def job_name(self, job: str) -> str:
        """The job's path relative to the root; refuses anything outside it."""
        name = self._names.get(job) if isinstance(job, str) else None
        if name is not None:
            return name
        name = self._job_name(job)
        if len(self._names) > 10_000:
            self._names.clear()
        self._names[job] = name
        return name

    def _job_name(self, job: str) -> str:
        if not isinstance(job, str) or not job or "\0" in job or len(job) > 4096:
            raise InvalidRequest(f"job path {job[:80]!r} is empty, too long or contains NUL")
        name = self.location.job_name(job)
        if self.scope is not None and name != self.scope:
            raise UnsafePath(
                f"job {job!r} is not served here: this is the embedded coordinator of job "
                f"{self.scope!r} under {self.root}, which serves that job alone; open a "
                "Checkpointer on the other job (or point both at one `ckptd serve`)"
            )
        return name

    def storage(self, job: str) -> Storage:
        s = self._storages.get(job)
        if s is None:
            s = self._storages[job] = self._storage_factory(self._job_dir(job))
        return s

    def _job_dir(self, job: str) -> str:
        return self.location.job_dir(job)

    def _found_storage(self, job: str) -> Storage | None:
        """The storage of a job a scan of the root listed, to read; None once it is gone.

        Never creates the job directory: `storage()` does (open_storage(create=True)), and a
        job removed after the scan listed it (a Lightning checkpoint that left the top k,
        removed while a coordinator for a sibling path started) must stay removed, not come
        back as an empty directory."""
        s = self._storages.get(job)
        if s is not None:
            return s
        path = self._job_dir(job)
        if not os.path.isdir(path):
            return None
        if not self._default_storage:  # an injected factory (tests): it decides
            return self.storage(job)
        return open_storage(path)

    # -- validation --------------------------------------------------------------------
    def _check_ref(self, ref: SaveRef) -> str:
        job = self.job_name(ref.job)
        if not 1 <= ref.world_size <= MAX_WORLD_SIZE:
            raise InvalidRequest(
                f"job {job!r} step {ref.step}: world_size {ref.world_size} out of range"
            )
        if not 0 <= ref.rank < ref.world_size:
            raise InvalidRequest(
                f"job {job!r} step {ref.step}: rank {ref.rank} not in [0, {ref.world_size})"
            )
        try:
            layout.check_step(ref.step)
        except ValueError as e:
            raise InvalidRequest(f"job {job!r}: {e}") from None
        if ref.generation < 0 or ref.generation >= 1 << 62:
            raise InvalidRequest(f"job {job!r}: generation {ref.generation} out of range")
        newest = self._newest_generation(job)
        if newest is not None and ref.generation < newest:
            raise StaleGeneration(
                f"job {job!r} step {ref.step} rank {ref.rank}: generation {ref.generation} is older "
                f"than the job's newest generation {newest}; this process belongs to a previous "
                "attempt and is fenced: it must exit"
            )
        return job

    def _find(self, ref: SaveRef, job: str) -> Session | SaveRecord | None:
        """The save `ref` names, the one way to look it up: the live session, else one that
        ended recently (a retry whose first reply was lost), else the catalog's record of
        that generation (ended before an eviction or a restart); None when unknown."""
        s = self.sessions.get((job, ref.step))
        if s is not None and s.generation == ref.generation:
            return s
        s = self.finished.get((job, ref.step, ref.generation))
        if s is not None:
            return s
        rec = self.catalog.save(job, ref.step)
        return rec if rec is not None and rec.generation == ref.generation else None

    def _session(self, ref: SaveRef, job: str) -> Session:
        """The session `ref` names, live or recently ended; an error for any other."""
        s = self._find(ref, job)
        if isinstance(s, SaveRecord):
            raise (
                SaveAborted(
                    f"job {job!r} step {ref.step}: the save is {s.status}"
                    + (f" ({s.reason})" if s.reason else "")
                )
                if s.status == ABORTED
                else CheckpointExists(f"job {job!r} step {ref.step} is {s.status}")
            )
        if s is None:
            raise InvalidRequest(
                f"job {job!r} step {ref.step} generation {ref.generation}: no such save "
                "(BeginSave first)"
            )
        if s.world_size != ref.world_size:
            raise InvalidRequest(
                f"job {job!r} step {ref.step}: rank {ref.rank} says world size {ref.world_size}, "
                f"the save has {s.world_size}"
            )
        s.last_seen[ref.rank] = time.monotonic()
        return s

    # -- RPCs --------------------------------------------------------------------------
    async def open_job(self, job: str, attempt: str) -> tuple[int, str]:
        """The generation of `attempt` of `job`: newest + 1 for a new attempt, else the same."""
        name = self.job_name(job)
        if not attempt or len(attempt) > 512:
            raise InvalidRequest(f"job {name!r}: attempt id must be 1..512 characters")
        async with self._open_lock:
            gen = self.catalog.attempt_generation(name, attempt)
            if gen is None:
                newest = self._newest_generation(name)
                gen = 0 if newest is None else newest + 1
                await self.catalog.record_attempt(name, attempt, gen)
                await self._advance_generation(name, gen)
        return gen, name

    async def begin_save(
        self, ref: SaveRef, chunks: Sequence[planning.ChunkPlan], **kw: Any
    ) -> BeginResult:
        """One rank's BeginSave (a part of its plan): join the save, then, once every rank
        has joined and the plan is made, the rank's answer (see join_save)."""
        return await self.planned_answer(await self.join_save(ref, chunks, **kw), ref)

    async def join_save(
        self,
        ref: SaveRef,
        chunks: Sequence[planning.ChunkPlan],
        *,
        part: int = 0,
        parts: int = 1,
        state: Any = None,
        metadata: dict[str, Any] | None = None,
        allow_divergent: bool = False,
        keep_last: int = 0,
        timeout_s: float | None = None,
        parent: int | None = None,
        node: str | None = None,
        layout_digest: bytes = b"",
        digests: bytes = b"",
        rank_state: list[Any] | None = None,
    ) -> Session | None:
        """One rank's plan (a part of it) joins the save: its session, or None while parts
        of the plan are still to come. The last rank to join makes the plan; none waits
        here for the others (planned_answer does). `node`: the aggregator that sent it
        (nodes.py). `rank_state`: the rank's per-rank entries, sent apart from `state`
        (values.split_per_rank)."""
        job = self._check_ref(ref)
        if not (1 <= parts <= 100_000 and 0 <= part < parts):
            raise InvalidRequest(
                f"job {job!r} step {ref.step} rank {ref.rank}: bad part {part}/{parts}"
            )
        if len(chunks) > MAX_PLAN_CHUNKS_PER_PART:
            raise InvalidRequest(
                f"job {job!r} step {ref.step} rank {ref.rank}: {len(chunks)} chunks in one part; "
                f"send at most {MAX_PLAN_CHUNKS_PER_PART} per part"
            )
        await self._advance_generation(job, ref.generation)
        s = self.sessions.get((job, ref.step))
        if s is None or s.generation < ref.generation:
            await self._open_session(ref, job, keep_last, parent, timeout_s)
        s = self._session(ref, job)
        if s.status == ABORTED:
            raise s.abort_kind(f"job {job!r} step {ref.step}: the save was aborted ({s.reason})")
        where = f"job {job!r} step {ref.step} rank {ref.rank}"
        cached = bool(layout_digest) and not chunks  # the layout's chunks, new digests
        try:
            s.claim(ref.rank, node)
            layouts.check_fields(layout_digest, digests, cached, where)
            if cached:
                chunks = self.layouts.plan(
                    job, ref.rank, layout_digest, part, parts, digests, where
                )
            for c in () if cached else chunks:
                planning.check_chunk(c, where)
            if metadata is not None and not isinstance(metadata, dict):
                raise InvalidRequest(f"{where}: metadata must be a JSON object")
            s.check_state(state, rank_state, where)
        except CkptError as e:
            # The other ranks learn it now instead of waiting out the barrier; an unknown
            # layout is no failure (the client resends the whole plan).
            if not isinstance(e, LayoutUnknown):
                await self._abort(s, str(e), kind=type(e), outcome=obs.FAILED)
            raise
        plan = s.plans.get(ref.rank)
        first_join = plan is None and not s.plans
        if plan is None:
            plan = s.plans[ref.rank] = RankPlan(parts)
        if plan.parts != parts:
            raise InvalidRequest(f"{where}: parts changed {plan.parts} -> {parts}")
        if part in plan.received and plan.received[part] != list(chunks):
            raise InvalidRequest(f"{where}: part {part} re-sent with a different plan")
        if plan.received and plan.layout != layout_digest:
            raise InvalidRequest(f"{where}: the parts of the plan name different layouts")
        plan.received[part], plan.layout = list(chunks), layout_digest
        if plan.complete and layout_digest and not cached:
            try:  # a lying claim could make later cached plans name other boxes
                self.layouts.accept(job, ref.rank, layout_digest, plan.by_part(), where)
            except InvalidRequest as e:
                await self._abort(s, str(e), kind=InvalidRequest, outcome=obs.FAILED)
                raise
        if state is not None:
            plan.state, plan.rank_state = state, rank_state
        if metadata:
            plan.metadata = metadata
        s.allow_divergent = s.allow_divergent or allow_divergent
        # Only a save's first join can make it disjoint from another waiting save (joined
        # ranks only grow, so a pair disjoint later was disjoint when the later of the two
        # got its first rank): looked at once a save, not at each of its ranks' joins.
        if first_join and step_mismatch(s, self.sessions.values()):
            self._spawn(self._abort_step_mismatch(s))
        if not plan.complete:
            return None
        if (
            s.assignment is None
            and len(s.plans) == s.world_size
            and all(p.complete for p in s.plans.values())
        ):
            await self._plan(s)
        return s

    async def _open_session(
        self,
        ref: SaveRef,
        job: str,
        keep_last: int,
        parent: int | None,
        timeout_s: float | None,
    ) -> None:
        """Open the save `ref` names, once: the first rank to join opens it (ending an older
        generation's), after checking that the step may be saved (retention.make_way: a
        quarantined copy gives way)."""
        async with self._step_dirs_lock(job):
            s = self.sessions.get((job, ref.step))
            if s is not None and s.generation < ref.generation:
                await self._abort(s, f"superseded by generation {ref.generation}")
            elif s is not None:
                return  # another rank opened it while this one waited
            rec = self.catalog.save(job, ref.step)
            # The save this generation ended: ended here (its abort may not be in the
            # catalog yet: a sibling rank of a node batch arrives meanwhile), or before.
            ended = self.finished.get((job, ref.step, ref.generation))
            gone = ended if ended is not None and ended.status == ABORTED else None
            if gone or (rec and rec.generation == ref.generation and rec.status == ABORTED):
                raise (gone.abort_kind if gone else SaveAborted)(
                    f"job {job!r} step {ref.step}: the save was aborted "
                    f"({gone.reason if gone else rec.reason if rec else ''})"
                )
            st = self.storage(job)
            where = f"job {job!r} step {ref.step} ({layout.step_dir(ref.step)})"
            # Storage decides whether the step holds a checkpoint (promise 6), read under
            # the lock: no retention is removing a step of this job meanwhile.
            if st.exists(f"{layout.step_dir(ref.step)}/{layout.MANIFEST_NAME}"):
                # No rank has written a file under its final name yet (a lone rank's shard
                # written ahead has a private name): nothing of this save is spared.
                await asyncio.to_thread(retention.make_way, st, ref.step, where=where)
            elif rec is not None and rec.status == COMMITTED:
                log.warning(
                    "%s: the catalog says committed, but storage holds no manifest of it "
                    "(removed outside the coordinator: ckptctl gc, or by hand); a new save "
                    "of the step begins",
                    where,
                )
            s = Session(job, ref.step, ref.generation, ref.world_size, keep_last, parent)
            s.barrier_deadline = time.monotonic() + (timeout_s or self.barrier_timeout_s)
            self.sessions[(job, ref.step)] = s
            await self.catalog.record_begin(
                job, ref.step, ref.generation, ref.world_size, keep_last, parent
            )

    def _step_dirs_lock(self, job: str) -> asyncio.Lock:
        """One job's step directories change under it one way at a time: a save opening (it
        may remove a quarantined step: make_way) and retention's removal of a step. Else
        a step removed by retention could take a new save's files of that step with it."""
        lock = self._dirs_locks.get(job)
        if lock is None:
            lock = self._dirs_locks[job] = asyncio.Lock()
        return lock

    async def planned_answer(self, s: Session | None, ref: SaveRef) -> BeginResult:
        """A joined rank's answer, once the save's plan is made (the barrier); for a rank
        whose plan has parts still to come (`s` None), that it is incomplete."""
        if s is None:
            return BeginResult("", "", [], self.lease_s, [], complete=False)
        try:
            await asyncio.shield(s.planned)
        except CkptError as e:
            raise type(e)(
                f"job {s.job!r} step {ref.step} rank {ref.rank}: the save was aborted: {s.reason}"
            ) from None
        assert s.assignment is not None
        return BeginResult(
            shard_path=layout.shard_name(ref.rank, ref.generation),
            index_path=layout.index_name(ref.rank, ref.generation),
            write=s.assignment.write[ref.rank],
            lease_s=self.lease_s,
            warnings=s.assignment.warnings,
            complete=True,
        )

    async def _plan(self, s: Session) -> None:
        try:
            s.chunks = {r: p.chunks() for r, p in s.plans.items()}
            key = s.layout_key()  # unchanged layouts: the last save's tiling and balance
            s.assignment = planning.assign(
                s.chunks, allow_divergent=s.allow_divergent, reuse=self.layouts.assigned(s.job, key)
            )
            self.layouts.keep_assigned(s.job, key, s.assignment)
            state = planning.merge_states(
                {r: p.state for r, p in s.plans.items()},
                {r: p.rank_state for r, p in s.plans.items() if p.rank_state},
            )
            metadata = s.plans[0].metadata if 0 in s.plans else {}
        except CkptError as e:
            await self._abort(s, str(e), kind=type(e), outcome=obs.FAILED)
            return
        except (ValueError, TypeError, RecursionError) as e:  # a plan nothing above caught
            await self._abort(
                s,
                f"the ranks' plans cannot be combined: {e}",
                kind=InvalidRequest,
                outcome=obs.FAILED,
            )
            return
        chunk_counts = {str(r): len(c) for r, c in s.chunks.items()}
        draft = {"state": state, "metadata": metadata, "chunks": chunk_counts}
        await self.catalog.record_draft(s.job, s.step, s.generation, draft)
        s.state, s.metadata = state, metadata
        now_m = time.monotonic()
        for r in range(s.world_size):
            s.last_seen.setdefault(r, now_m)
            s.last_seen[r] = max(s.last_seen[r], now_m)
        crash_point("coordinator.after_barrier")
        if not s.planned.done():
            s.planned.set_result(None)

    async def _abort_step_mismatch(self, s: Session) -> None:
        """Abort every save that still cannot complete alongside `s` after the grace
        (session.step_mismatch): each rank learns the steps in seconds, not at the barrier
        timeout."""
        await asyncio.sleep(STEP_MISMATCH_GRACE_S)
        saves = step_mismatch(s, self.sessions.values())
        reason = step_mismatch_reason(saves) if saves else ""
        for x in saves:
            await self._abort(x, reason, kind=StepMismatch, outcome=obs.FAILED)

    def _ended(self, ref: SaveRef, job: str) -> StatusResult | None:
        """The final answer for a save this process no longer holds (ended before a
        restart of the coordinator), from the catalog; None when it is live or unknown."""
        rec = self._find(ref, job)
        if isinstance(rec, SaveRecord) and rec.status in (COMMITTED, ABORTED):
            return rec.answer()
        return None

    async def keep_alive(self, ref: SaveRef, node: str | None = None) -> StatusResult:
        job = self._check_ref(ref)
        ended = self._ended(ref, job)
        if ended is not None:
            return ended
        s = self._session(ref, job)
        s.speaks_for(ref.rank, node)
        return s.answer()

    async def _commit(self, s: Session) -> None:
        st = self.storage(s.job)
        try:
            block = one_block_size(s.step, s.block_sizes.values())
            m = manifest_of(s, block, s.reports, s.state, s.metadata)
            if s.status != COMMITTING:
                return
            await self.catalog.mark_committing(s.job, s.step, s.generation)
            data = await asyncio.to_thread(ckfmt.commit, st, m)
        except (CkptError, OSError, ValueError) as e:
            # The ranks raise the cause: a full disk here is a StorageError on every rank.
            kind = type(e) if isinstance(e, CkptError) else StorageError
            await self._abort(s, f"commit failed: {e}", kind=kind, outcome=obs.FAILED)
            return
        crash_point("coordinator.after_manifest_rename")
        digest = hashing.digest(data)
        s.manifest_blake3 = digest
        total = sum(x.size for x in m.shards)
        at = await self.catalog.mark_committed(s.job, s.step, s.generation, digest, total)
        crash_point("coordinator.after_catalog_commit")
        # What the step borrows, in retention's memo: its retention need not read back the
        # manifest just written (at scale, a shard a rank).
        retention.remember_borrows(self._borrowed_memo(s.job), s.step, at, m.borrows)
        s.status = COMMITTED
        if not s.done.done():
            s.done.set_result(StatusResult(COMMITTED, "", digest))
        log.info(
            "committed job %s step %d (%d ranks, %.2f GB)", s.job, s.step, s.world_size, total / 1e9
        )
        self.observer.save_ended(
            s.job, s.step, obs.COMMITTED, bytes=total, commit_s=time.monotonic() - s.all_reported
        )
        self._finish(s)
        if s.keep_last > 0:
            self._spawn(self._retention(s.job, s.keep_last, s.step))

    async def await_commit(self, ref: SaveRef, timeout_s: float | None = None) -> StatusResult:
        job = self._check_ref(ref)
        s = self._find(ref, job)
        if s is None:
            raise InvalidRequest(
                f"job {job!r} step {ref.step} generation {ref.generation}: no such save"
            )
        if isinstance(s, SaveRecord):
            return s.answer()
        s.last_seen[ref.rank] = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(s.done), timeout_s)
        except TimeoutError:
            return s.answer()

    async def abort_save(self, ref: SaveRef, reason: str) -> StatusResult:
        job = self._check_ref(ref)
        found = self._find(ref, job)
        if isinstance(found, SaveRecord):
            return found.answer()
        s = found
        if s is None:
            rec = self.catalog.save(job, ref.step)
            if rec is not None and rec.status == COMMITTED:
                raise CheckpointExists(f"job {job!r} step {ref.step} is already committed")
            # This rank failed before any rank began: record the abort so the others'
            # BeginSave fails at once instead of waiting out the barrier.
            await self._advance_generation(job, ref.generation)
            s = Session(job, ref.step, ref.generation, ref.world_size, 0)
            self.sessions[(job, ref.step)] = s
            await self.catalog.record_begin(job, ref.step, ref.generation, ref.world_size)
        if s.status in (OPEN,):
            await self._abort(
                s, f"rank {ref.rank} aborted: {reason[:1000]}", asked_by_sole_rank=s.world_size == 1
            )
        return s.answer()

    # -- aborts, leases, retention -----------------------------------------------------
    def _newest_generation(self, job: str) -> int | None:
        if job not in self._generations:
            self._generations[job] = self.catalog.generation(job)
        return self._generations[job]

    async def _advance_generation(self, job: str, generation: int) -> None:
        newest = self._newest_generation(job)
        if newest is not None and generation < newest:
            raise StaleGeneration(f"job {job!r}: generation {generation} is older than {newest}")
        if newest is None or generation > newest:
            await self.catalog.set_generation(job, generation)
            if (self._generations.get(job) or 0) <= generation:
                self._generations[job] = generation
            for (j, _), s in list(self.sessions.items()):
                if j == job and s.generation < generation and s.status == OPEN:
                    await self._abort(
                        s, f"superseded by generation {generation} (the job restarted)"
                    )
            await self._fence_memory(job, generation)

    async def _abort(
        self,
        s: Session,
        reason: str,
        kind: type[CkptError] = SaveAborted,
        outcome: str = obs.ABORTED,
        asked_by_sole_rank: bool = False,
    ) -> None:
        if s.status in (COMMITTED, ABORTED):
            return
        # No rank is writing any more: every one has reported, or the only one gave up. Then
        # the step directory goes too when nothing else is in it (else retention removes it).
        idle = asked_by_sole_rank or len(s.reports) == s.world_size
        self.observer.save_ended(s.job, s.step, outcome)
        log.warning(
            "aborting job %s step %d generation %d: %s", s.job, s.step, s.generation, reason
        )
        # No other transition from here on; a rank arriving meanwhile gets the same error.
        s.status, s.reason, s.abort_kind = ABORTED, reason, kind
        self._finish(s)
        remove = functools.partial(
            self._remove_files, s.job, s.step, s.generation, range(s.world_size), idle
        )
        try:
            await self.catalog.mark_aborted(s.job, s.step, s.generation, reason)
            if idle:
                # No rank is writing: the files go before the answer, so the failure a rank
                # raises finds its save's files (and the empty step directory) gone.
                await asyncio.to_thread(remove)
        finally:
            # The ranks are told only now: were they told first, a coordinator dying here
            # would leave them with ABORTED while its restart (the reports are all durable)
            # commits the very same save.
            s.fail(reason, kind)
        if not idle:
            self._spawn(asyncio.to_thread(remove))

    def _finish(self, s: Session) -> None:
        if self.sessions.get((s.job, s.step)) is s:
            del self.sessions[(s.job, s.step)]
        self.finished[(s.job, s.step, s.generation)] = s
        s.release()
        # An ended save of 4,096 ranks still holds every rank's report (megabytes), so the
        # bound counts ranks too; an evicted save is answered from the catalog.
        while len(self.finished) > MAX_FINISHED_SAVES or (
            len(self.finished) > 1
            and sum(x.world_size for x in self.finished.values()) > MAX_FINISHED_RANKS
        ):
            self.finished.popitem(last=False)

    def _remove_files(
        self, job: str, step: int, generation: int, ranks: Iterable[int], idle: bool = False
    ) -> None:
        """An aborted save's files of these ranks (blocking: run in a thread); with `idle`
        (no rank of it still writing), the step directory too when that left it empty and
        no newer save of the step is live."""
        st = self.storage(job)
        remove_ranks_files(st, step, generation, ranks)
        if idle and (job, step) not in self.sessions:
            remove_empty_step(st, step)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(self.lease_s, self.barrier_timeout_s) / 4))
            t = time.monotonic()
            for s in list(self.sessions.values()):
                reason = s.overdue(t, self.lease_s)
                if reason is not None:
                    await self._abort(s, reason)
            await self._memory_overdue(t)

    def _borrowed_memo(self, job: str) -> dict[tuple[int, float], tuple[int, ...]]:
        """The steps of `job` whose borrows are known, by (step, committed_unix): a
        committed manifest never changes (retention.with_borrows)."""
        return self._borrows.setdefault(job, {})

    async def _retention(self, job: str, keep_last: int, committed: int) -> None:
        """Carry out the job's retention plan (ckptd.coordinator.retention, the one rule).

        A retired step is listed in the catalog's `retiring` table before anything of it is
        removed, so a restart finishes exactly these steps (`_finish_retention`). The step
        just `committed` is never removed by its own commit's retention."""
        st = self.storage(job)
        try:
            dirs = await asyncio.to_thread(retention.step_dirs, st)
        except (OSError, CkptError) as e:
            log.warning("retention: could not list job %s: %s", job, e)
            return
        in_flight = {step for j, step in self.sessions if j == job}
        steps = retention.from_catalog(self.catalog.saves(job), dirs, in_flight)
        # What the steps borrow (incremental saves): from their manifests, each read once.
        known = self._borrowed_memo(job)
        steps = await asyncio.to_thread(retention.with_borrows, st, steps, known)
        plan = retention.plan(steps, keep_last, keep=(committed,))
        await retention.carry_out(
            self.catalog,
            st,
            job,
            plan,
            began=lambda step: (job, step) in self.sessions,
            lock=self._step_dirs_lock(job),
        )
