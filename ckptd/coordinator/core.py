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
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from ckptd import knobs
from ckptd.coordinator import observer as obs
from ckptd.coordinator import planning
from ckptd.coordinator.catalog import Catalog, SaveRecord, now
from ckptd.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CkptError,
    InvalidRequest,
    SaveAborted,
    StaleGeneration,
)
from ckptd.faults import crash_point
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, layout, recycle, values
from ckptd.format.manifest import Manifest, ShardInfo, load_json, parse_index
from ckptd.storage import JobLocation, Storage, open_storage

log = logging.getLogger("ckptd.coordinator")

OPEN, COMMITTING, COMMITTED, ABORTED = "OPEN", "COMMITTING", "COMMITTED", "ABORTED"
QUARANTINED = "QUARANTINED"  # committed, then failed verification when loaded
# What a mirror tier holds of a step (catalog table `tiers`).
TIER_UPLOADING, TIER_HELD, TIER_FAILED, TIER_REMOVED = "UPLOADING", "HELD", "FAILED", "REMOVED"
TIER_STATUSES = frozenset({TIER_UPLOADING, TIER_HELD, TIER_FAILED})
MAX_PLAN_CHUNKS_PER_PART = 20_000
MAX_WORLD_SIZE = layout.MAX_RANK + 1
# Ended saves kept in memory to answer retries whose first reply was lost.
MAX_FINISHED_SAVES = 256
MAX_FINISHED_RANKS = 32_768


@dataclasses.dataclass(frozen=True)
class SaveRef:
    job: str
    step: int
    generation: int
    rank: int
    world_size: int


@dataclasses.dataclass(frozen=True)
class ShardReport:
    shard_path: str
    size: int
    index_path: str
    index_size: int
    index_blake3: str
    verify: str = "full"
    # The rank's own timings (for metrics); not part of the report's identity, so a retried
    # report still matches.
    staging_s: float = dataclasses.field(default=0.0, compare=False)
    persist_s: float = dataclasses.field(default=0.0, compare=False)
    write_s: float = dataclasses.field(default=0.0, compare=False)
    verify_s: float = dataclasses.field(default=0.0, compare=False)

    @classmethod
    def of(cls, info: ShardInfo, verify: str, **timings: float) -> ShardReport:
        """The report of a written shard (ckptd.format.writer's ShardInfo)."""
        return cls(
            info.path, info.size, info.index, info.index_size, info.index_blake3, verify, **timings
        )


@dataclasses.dataclass
class BeginResult:
    shard_path: str
    index_path: str
    write: list[int]
    lease_s: float
    warnings: list[str]
    complete: bool


@dataclasses.dataclass
class StatusResult:
    status: str
    reason: str = ""
    manifest_blake3: str = ""


@dataclasses.dataclass
class _RankPlan:
    parts: int
    received: dict[int, list[planning.ChunkPlan]] = dataclasses.field(default_factory=dict)
    state: Any = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.received) == self.parts

    def chunks(self) -> list[planning.ChunkPlan]:
        return [c for p in range(self.parts) for c in self.received[p]]


class Session:
    def __init__(self, job: str, step: int, generation: int, world_size: int, keep_last: int):
        self.job, self.step, self.generation, self.world_size = job, step, generation, world_size
        self.keep_last = keep_last
        self.status = OPEN
        self.reason = ""
        self.plans: dict[int, _RankPlan] = {}
        self.assignment: planning.Assignment | None = None
        self.chunks: dict[int, list[planning.ChunkPlan]] = {}
        self.reports: dict[int, ShardReport] = {}
        self.last_seen: dict[int, float] = {}
        self.created = time.monotonic()
        self.barrier_deadline = self.created
        self.allow_divergent = False
        self.planned: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.done: asyncio.Future[StatusResult] = asyncio.get_running_loop().create_future()
        self.commit_task: asyncio.Task[None] | None = None
        self.manifest_blake3 = ""
        self.bytes = 0
        self.state: Any = None  # merged state tree, once planned
        self.block_sizes: dict[int, int] = {}  # from each reported index
        self.metadata: dict[str, Any] = {}
        self.all_reported = 0.0  # monotonic time of the last shard's report
        self.abort_kind: type[CkptError] = SaveAborted  # what a rank arriving later gets

    def fail(self, reason: str, kind: type[CkptError] = SaveAborted) -> None:
        self.status, self.reason, self.abort_kind = ABORTED, reason, kind
        if not self.planned.done():
            self.planned.set_exception(kind(reason))
            self.planned.exception()  # mark retrieved: not every rank may be waiting
        if not self.done.done():
            self.done.set_result(StatusResult(ABORTED, reason))


class Coordinator:
    """Transport-free coordinator over one storage root."""

    def __init__(
        self,
        root: str,
        catalog: Catalog,
        *,
        lease_s: float = 60.0,
        barrier_timeout_s: float = 600.0,
        storage_factory: Callable[[str], Storage] | None = None,
    ):
        self.location = JobLocation.of(root)
        self.root = self.location.path
        self.catalog = catalog
        self.lease_s = lease_s
        self.barrier_timeout_s = barrier_timeout_s
        self._storage_factory = storage_factory or (lambda p: open_storage(p, create=True))
        self._default_storage = storage_factory is None
        self.observer: obs.SaveObserver = obs.SaveObserver()  # metrics plug in here
        self._storages: dict[str, Storage] = {}
        self.sessions: dict[tuple[str, int], Session] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._open_lock = asyncio.Lock()
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
        return self.location.job_name(job)

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

    def _session(self, ref: SaveRef, job: str) -> Session:
        s = self.sessions.get((job, ref.step))
        if s is None or s.generation != ref.generation:
            # A retry after the end (a lost reply): answer from the recently finished.
            s = self.finished.get((job, ref.step, ref.generation))
        if s is None:
            rec = self.catalog.save(job, ref.step)
            if rec is not None and rec.generation == ref.generation:
                raise (
                    SaveAborted(
                        f"job {job!r} step {ref.step}: the save is {rec.status}"
                        + (f" ({rec.reason})" if rec.reason else "")
                    )
                    if rec.status == ABORTED
                    else CheckpointExists(f"job {job!r} step {ref.step} is {rec.status}")
                )
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
                await self.catalog.write(
                    "INSERT INTO attempts (job, attempt, generation) VALUES (?, ?, ?)",
                    (name, attempt, gen),
                )
                await self._advance_generation(name, gen)
        return gen, name

    async def begin_save(
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
    ) -> BeginResult:
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
        if s is not None and s.generation < ref.generation:
            await self._abort(s, f"superseded by generation {ref.generation}")
            s = None
        if s is None:
            rec = self.catalog.save(job, ref.step)
            if rec is not None and rec.status == COMMITTED:
                raise CheckpointExists(
                    f"job {job!r} step {ref.step} ({layout.step_dir(ref.step)}) is already "
                    "committed; save under a new step"
                )
            if rec is not None and rec.generation == ref.generation and rec.status == ABORTED:
                raise SaveAborted(
                    f"job {job!r} step {ref.step}: the save was aborted ({rec.reason})"
                )
            if self.storage(job).exists(f"{layout.step_dir(ref.step)}/{layout.MANIFEST_NAME}"):
                raise CheckpointExists(
                    f"job {job!r} step {ref.step} ({layout.step_dir(ref.step)}) is already "
                    "committed in storage; save under a new step"
                )
            s = Session(job, ref.step, ref.generation, ref.world_size, keep_last)
            s.barrier_deadline = time.monotonic() + (timeout_s or self.barrier_timeout_s)
            self.sessions[(job, ref.step)] = s
            await self.catalog.write(
                "INSERT OR REPLACE INTO saves (job, step, generation, world_size, status, created_unix, keep_last) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (job, ref.step, ref.generation, ref.world_size, OPEN, now(), keep_last),
            )
        s = self._session(ref, job)
        if s.status == ABORTED:
            raise s.abort_kind(f"job {job!r} step {ref.step}: the save was aborted ({s.reason})")
        where = f"job {job!r} step {ref.step} rank {ref.rank}"
        try:
            for c in chunks:
                planning.check_chunk(c, where)
            if metadata is not None and not isinstance(metadata, dict):
                raise InvalidRequest(f"{where}: metadata must be a JSON object")
            if state is not None:
                values.check_node(state, f"{where} state")
        except CkptError as e:
            # The other ranks learn it now instead of waiting out the barrier.
            await self._abort(s, str(e), kind=type(e), outcome=obs.FAILED)
            raise
        plan = s.plans.get(ref.rank)
        if plan is None:
            plan = s.plans[ref.rank] = _RankPlan(parts)
        if plan.parts != parts:
            raise InvalidRequest(
                f"job {job!r} step {ref.step} rank {ref.rank}: parts changed {plan.parts} -> {parts}"
            )
        if part in plan.received and plan.received[part] != list(chunks):
            raise InvalidRequest(
                f"job {job!r} step {ref.step} rank {ref.rank}: part {part} re-sent with a different plan"
            )
        plan.received[part] = list(chunks)
        if state is not None:
            plan.state = state
        if metadata:
            plan.metadata = metadata
        s.allow_divergent = s.allow_divergent or allow_divergent
        if not plan.complete:
            return BeginResult("", "", [], self.lease_s, [], complete=False)
        if (
            s.assignment is None
            and len(s.plans) == s.world_size
            and all(p.complete for p in s.plans.values())
        ):
            await self._plan(s)
        try:
            await asyncio.shield(s.planned)
        except CkptError as e:
            raise type(e)(
                f"job {job!r} step {ref.step} rank {ref.rank}: the save was aborted: {s.reason}"
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
            s.assignment = planning.assign(s.chunks, allow_divergent=s.allow_divergent)
            state = planning.merge_states({r: p.state for r, p in s.plans.items()})
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
        draft = json.dumps({"state": state, "metadata": metadata, "chunks": _chunks_json(s.chunks)})
        await self.catalog.write(
            "UPDATE saves SET draft=? WHERE job=? AND step=? AND generation=?",
            (draft, s.job, s.step, s.generation),
        )
        s.state, s.metadata = state, metadata
        now_m = time.monotonic()
        for r in range(s.world_size):
            s.last_seen.setdefault(r, now_m)
            s.last_seen[r] = max(s.last_seen[r], now_m)
        crash_point("coordinator.after_barrier")
        if not s.planned.done():
            s.planned.set_result(None)

    def _ended(self, ref: SaveRef, job: str) -> StatusResult | None:
        """The final answer for a save this process no longer holds (ended before a
        restart of the coordinator), from the catalog; None when it is live or unknown."""
        s = self.sessions.get((job, ref.step))
        if s is not None and s.generation == ref.generation:
            return None
        if (job, ref.step, ref.generation) in self.finished:
            return None
        rec = self.catalog.save(job, ref.step)
        if (
            rec is not None
            and rec.generation == ref.generation
            and rec.status in (COMMITTED, ABORTED)
        ):
            return StatusResult(rec.status, rec.reason, rec.manifest_blake3)
        return None

    async def keep_alive(self, ref: SaveRef) -> StatusResult:
        job = self._check_ref(ref)
        ended = self._ended(ref, job)
        if ended is not None:
            return ended
        s = self._session(ref, job)
        return StatusResult(s.status, s.reason, s.manifest_blake3)

    async def report_shard(self, ref: SaveRef, report: ShardReport) -> StatusResult:
        try:
            job = self._check_ref(ref)
        except StaleGeneration:
            # The fenced rank wrote files of its own generation; they are nobody's now.
            name = self.job_name(ref.job)
            self._spawn(
                asyncio.to_thread(self._remove_rank_files, name, ref.step, ref.generation, ref.rank)
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
                    asyncio.to_thread(
                        self._remove_rank_files, job, ref.step, ref.generation, ref.rank
                    )
                )
            return ended
        if s.assignment is None:
            raise InvalidRequest(
                f"job {job!r} step {ref.step} rank {ref.rank}: ReportShard before the plan was made"
            )
        prev = s.reports.get(ref.rank)
        if prev is not None:
            if prev == report:
                return StatusResult(s.status, s.reason, s.manifest_blake3)
            raise InvalidRequest(
                f"job {job!r} step {ref.step} rank {ref.rank}: shard reported twice with different "
                f"contents (index blake3 {prev.index_blake3[:12]} then {report.index_blake3[:12]})"
            )
        if s.status != OPEN:
            return StatusResult(s.status, s.reason, s.manifest_blake3)
        want_shard, want_index = (
            layout.shard_name(ref.rank, s.generation),
            layout.index_name(ref.rank, s.generation),
        )
        if report.shard_path != want_shard or report.index_path != want_index:
            raise InvalidRequest(
                f"job {job!r} step {ref.step} rank {ref.rank}: reported {report.shard_path!r}, "
                f"assigned {want_shard!r}"
            )
        if report.verify not in ("full", "size"):
            raise InvalidRequest(
                f"job {job!r} step {ref.step} rank {ref.rank}: verify must be full or size"
            )
        try:
            await asyncio.to_thread(self._check_report, s, ref.rank, report)
        except CkptError as e:
            self.observer.verification_failed(job, ref.step, "report", f"rank {ref.rank}: {e}")
            await self._abort(s, f"rank {ref.rank}: {e}", outcome=obs.FAILED)
            return StatusResult(ABORTED, s.reason)
        await self.catalog.write(
            "INSERT OR REPLACE INTO reports (job, step, generation, rank, report) VALUES (?, ?, ?, ?, ?)",
            (job, ref.step, ref.generation, ref.rank, json.dumps(dataclasses.asdict(report))),
        )
        if s.status != OPEN:  # aborted while we checked
            return StatusResult(s.status, s.reason)
        s.reports[ref.rank] = report
        self.observer.shard_reported(job, ref.step, ref.rank, report)
        if len(s.reports) == s.world_size and s.commit_task is None:
            s.status = COMMITTING
            s.all_reported = time.monotonic()
            s.commit_task = asyncio.get_running_loop().create_task(self._commit(s))
        return StatusResult(s.status, s.reason, s.manifest_blake3)

    def _check_report(self, s: Session, rank: int, report: ShardReport) -> None:
        """The coordinator's own look at a shard: sizes, index hash, and the chunks it holds."""
        st = self.storage(s.job)
        sdir = layout.step_dir(s.step)
        size = st.size(f"{sdir}/{report.shard_path}")
        if size != report.size:
            raise CkptError(
                f"{st.url}/{sdir}/{report.shard_path} is {size} bytes, the rank reported {report.size}"
            )
        data = st.read_bytes(f"{sdir}/{report.index_path}", limit=report.index_size)
        if len(data) != report.index_size or hashing.digest(data) != report.index_blake3:
            raise CkptError(
                f"{st.url}/{sdir}/{report.index_path} does not match the reported size/blake3"
            )
        assert s.assignment is not None
        where = f"{st.url}/{sdir}/{report.index_path}"
        doc = load_json(data, where)  # parsed once: the block size first, then the index
        block_size = _index_block_size(doc)
        s.block_sizes[rank] = block_size
        draft = Manifest(
            job=s.job,
            step=s.step,
            generation=s.generation,
            world_size=s.world_size,
            block_size=block_size,
            alignment=4096,
            shards=[],
            state=None,
        )
        shard = ShardInfo(
            rank,
            report.shard_path,
            report.size,
            report.index_path,
            report.index_size,
            report.index_blake3,
        )
        index = parse_index(
            None, manifest=draft, shard=shard, max_entries=10**7, what=where, doc=doc
        )
        planned = s.chunks[rank]
        want = {
            (planned[i].key, planned[i].chunk_offsets, planned[i].chunk_sizes): planned[i]
            for i in s.assignment.write[rank]
        }
        got = {(e.key, tuple(e.chunk_offsets), tuple(e.chunk_sizes)): e for e in index.entries}
        if set(want) != set(got):
            missing = sorted(k[0] for k in set(want) - set(got))[:5]
            extra = sorted(k[0] for k in set(got) - set(want))[:5]
            raise CkptError(
                f"shard index holds other chunks than assigned (missing {missing}, unexpected {extra})"
            )
        for k, c in want.items():
            e = got[k]
            if (
                e.dtype != c.dtype
                or e.length != c.length
                or hashing.chunk_digest(e.blake3) != c.blake3
            ):
                raise CkptError(
                    f"key {k[0]!r}: the shard holds other bytes than the rank planned (hash mismatch)"
                )
        s.bytes += report.size

    async def _commit(self, s: Session) -> None:
        st = self.storage(s.job)
        shards = [
            ShardInfo(r, rep.shard_path, rep.size, rep.index_path, rep.index_size, rep.index_blake3)
            for r, rep in sorted(s.reports.items())
        ]
        try:
            sizes = set(s.block_sizes.values())
            if len(sizes) != 1:
                raise CkptError(
                    f"step {s.step}: ranks used different hash block sizes {sorted(sizes)}; "
                    "set CKPT_BLOCK_SIZE equally on every rank"
                )
            block = sizes.pop()
            m = Manifest(
                job=s.job,
                step=s.step,
                generation=s.generation,
                world_size=s.world_size,
                block_size=block,
                alignment=4096,
                shards=shards,
                state=s.state,
                metadata=s.metadata,
            )
            if s.status != COMMITTING:
                return
            await self.catalog.write(
                "UPDATE saves SET status=? WHERE job=? AND step=? AND generation=?",
                (COMMITTING, s.job, s.step, s.generation),
            )
            data = await asyncio.to_thread(ckfmt.commit, st, m)
        except (CkptError, OSError, ValueError) as e:
            await self._abort(s, f"commit failed: {e}", outcome=obs.FAILED)
            return
        crash_point("coordinator.after_manifest_rename")
        digest = hashing.digest(data)
        s.manifest_blake3 = digest
        total = sum(x.size for x in shards)
        await self.catalog.write(
            "UPDATE saves SET status=?, committed_unix=?, manifest_blake3=?, bytes=?, draft=NULL "
            "WHERE job=? AND step=? AND generation=?",
            (COMMITTED, now(), digest, total, s.job, s.step, s.generation),
        )
        await self.catalog.write(
            "DELETE FROM reports WHERE job=? AND step=? AND generation=?",
            (s.job, s.step, s.generation),
        )
        crash_point("coordinator.after_catalog_commit")
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
        if s.keep_last:
            self._spawn(self._retention(s.job, s.keep_last))

    async def await_commit(self, ref: SaveRef, timeout_s: float | None = None) -> StatusResult:
        job = self._check_ref(ref)
        s = self.sessions.get((job, ref.step))
        if s is None or s.generation != ref.generation:
            s = self.finished.get((job, ref.step, ref.generation))
        if s is None:
            rec = self.catalog.save(job, ref.step)
            if rec is None or rec.generation != ref.generation:
                raise InvalidRequest(
                    f"job {job!r} step {ref.step} generation {ref.generation}: no such save"
                )
            return StatusResult(rec.status, rec.reason, rec.manifest_blake3)
        s.last_seen[ref.rank] = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(s.done), timeout_s)
        except TimeoutError:
            return StatusResult(s.status, s.reason, s.manifest_blake3)

    async def abort_save(self, ref: SaveRef, reason: str) -> StatusResult:
        job = self._check_ref(ref)
        s = self.sessions.get((job, ref.step))
        if s is None or s.generation != ref.generation:
            rec = self.catalog.save(job, ref.step)
            if rec is not None and rec.generation == ref.generation:
                return StatusResult(rec.status, rec.reason, rec.manifest_blake3)
            if rec is not None and rec.status == COMMITTED:
                raise CheckpointExists(f"job {job!r} step {ref.step} is already committed")
            # This rank failed before any rank began: record the abort so the others'
            # BeginSave fails at once instead of waiting out the barrier.
            await self._advance_generation(job, ref.generation)
            s = Session(job, ref.step, ref.generation, ref.world_size, 0)
            self.sessions[(job, ref.step)] = s
            await self.catalog.write(
                "INSERT OR REPLACE INTO saves (job, step, generation, world_size, status, created_unix) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (job, ref.step, ref.generation, ref.world_size, OPEN, now()),
            )
        if s.status in (OPEN,):
            await self._abort(s, f"rank {ref.rank} aborted: {reason[:1000]}")
        return StatusResult(s.status, s.reason, s.manifest_blake3)

    # -- catalog queries ---------------------------------------------------------------
    def list_checkpoints(self, job: str) -> list[SaveRecord]:
        return self.catalog.saves(self.job_name(job))

    def get_checkpoint(self, job: str, step: int | None) -> SaveRecord:
        name = self.job_name(job)
        if step is not None:
            _check_step(name, step)
        if step is None:
            committed = self.catalog.saves(name, COMMITTED)
            if not committed:
                raise CheckpointNotFound(f"job {name!r} has no committed checkpoint")
            return committed[-1]
        rec = self.catalog.save(name, step)
        if rec is None:
            raise CheckpointNotFound(f"job {name!r} has no step {step}")
        return rec

    async def quarantine(self, job: str, step: int, reason: str) -> SaveRecord:
        """Mark a committed step QUARANTINED (a load found it corrupt); idempotent.

        The marker in the step directory is written too when the loader could not (storage
        is the truth: rebuild-catalog reads it back).
        """
        name = self.job_name(job)
        _check_step(name, step)
        rec = self.catalog.save(name, step)
        if rec is None or rec.status not in (COMMITTED, QUARANTINED):
            raise CheckpointNotFound(f"job {name!r} has no committed step {step} to quarantine")
        st = self.storage(name)
        reason = reason[:4000] or "quarantined"
        if await asyncio.to_thread(ckfmt.quarantine_reason, st, step) is None:
            await asyncio.to_thread(ckfmt.quarantine, st, step, reason)
        if rec.status != QUARANTINED:
            log.warning("job %s step %d quarantined: %s", name, step, reason)
            self.observer.verification_failed(name, step, "load", reason)
            await self.catalog.write(
                "UPDATE saves SET status=?, reason=? WHERE job=? AND step=?",
                (QUARANTINED, reason, name, step),
            )
        rec = self.catalog.save(name, step)
        assert rec is not None
        return rec

    async def record_tier(
        self, job: str, step: int, tier: str, url: str, status: str, reason: str = ""
    ) -> None:
        """Record what a tier (a mirror) holds of a step; status REMOVED deletes the record.

        The client that copies a committed step to a mirror reports each transition
        (UPLOADING, HELD, FAILED, REMOVED); storage stays the truth (a mirror's step is
        committed when its manifest is there), this is the catalog's view for listing.
        """
        name = self.job_name(job)
        if status == TIER_REMOVED:
            await self.catalog.write(
                "DELETE FROM tiers WHERE job=? AND step=? AND tier=?", (name, step, tier)
            )
            return
        if status not in TIER_STATUSES:
            raise InvalidRequest(f"job {name!r} step {step}: unknown tier status {status!r}")
        await self.catalog.write(
            "INSERT OR REPLACE INTO tiers (job, step, tier, url, status, reason, updated_unix) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (name, step, tier, url, status, reason[:4000], now()),
        )

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
            await self.catalog.write(
                "INSERT OR REPLACE INTO jobs (job, generation) VALUES (?, ?)", (job, generation)
            )
            if (self._generations.get(job) or 0) <= generation:
                self._generations[job] = generation
            for (j, _), s in list(self.sessions.items()):
                if j == job and s.generation < generation and s.status == OPEN:
                    await self._abort(
                        s, f"superseded by generation {generation} (the job restarted)"
                    )

    async def _abort(
        self,
        s: Session,
        reason: str,
        kind: type[CkptError] = SaveAborted,
        outcome: str = obs.ABORTED,
    ) -> None:
        if s.status in (COMMITTED, ABORTED):
            return
        self.observer.save_ended(s.job, s.step, outcome)
        log.warning(
            "aborting job %s step %d generation %d: %s", s.job, s.step, s.generation, reason
        )
        # No other transition from here on; a rank arriving meanwhile gets the same error.
        s.status, s.reason, s.abort_kind = ABORTED, reason, kind
        self._finish(s)
        try:
            await self.catalog.write(
                "UPDATE saves SET status=?, reason=?, draft=NULL WHERE job=? AND step=? AND generation=?",
                (ABORTED, reason[:4000], s.job, s.step, s.generation),
            )
            await self.catalog.write(
                "DELETE FROM reports WHERE job=? AND step=? AND generation=?",
                (s.job, s.step, s.generation),
            )
        finally:
            # The ranks are told only now: were they told first, a coordinator dying here
            # would leave them with ABORTED while its restart (the reports are all durable)
            # commits the very same save.
            s.fail(reason, kind)
        self._spawn(
            asyncio.to_thread(
                self._remove_generation_files, s.job, s.step, s.generation, s.world_size
            )
        )

    def _finish(self, s: Session) -> None:
        if self.sessions.get((s.job, s.step)) is s:
            del self.sessions[(s.job, s.step)]
        self.finished[(s.job, s.step, s.generation)] = s
        s.plans.clear()  # plans can be large; the answers (reports, status) are kept
        s.chunks.clear()
        # An ended save of 4,096 ranks still holds ~4 MiB (every rank's report, the merged
        # state), so the bound counts ranks too; an evicted save is answered from the catalog.
        while len(self.finished) > MAX_FINISHED_SAVES or (
            len(self.finished) > 1
            and sum(x.world_size for x in self.finished.values()) > MAX_FINISHED_RANKS
        ):
            self.finished.popitem(last=False)

    def _remove_generation_files(
        self, job: str, step: int, generation: int, world_size: int
    ) -> None:
        """Remove an aborted save's files: only its own generation's, never a manifest,
        never a file the step's manifest (of another generation) references."""
        for r in range(world_size):
            self._remove_rank_files(job, step, generation, r)
        self._remove_empty_step(job, step)

    def _remove_empty_step(self, job: str, step: int) -> None:
        """Remove a step directory that an abort left empty (no manifest, no shard of any
        generation), so an aborted save leaves nothing behind. A save of the same step by a
        newer generation has files there (it writes only after its BeginSave), and then
        the directory stays; were one to start writing in between, its shard would fail
        verification and its save abort: never a commit of a partial step."""
        if (job, step) in self.sessions:
            return
        st = self.storage(job)
        sdir = layout.step_dir(step)
        try:
            names = st.listdir(sdir)
            if set(names) <= {layout.SHARDS_DIR} and not st.listdir(f"{sdir}/{layout.SHARDS_DIR}"):
                st.remove_tree(sdir)
        except (OSError, CkptError) as e:
            log.warning("could not remove the empty step directory %s/%s: %s", st.url, sdir, e)

    def _remove_rank_files(self, job: str, step: int, generation: int, rank: int) -> None:
        st = self.storage(job)
        sdir = layout.step_dir(step)
        referenced: set[str] = set()
        if st.exists(f"{sdir}/{layout.MANIFEST_NAME}"):
            try:
                m = ckfmt.read_manifest(st, step)
            except CkptError:
                return  # cannot tell what the committed step needs: touch nothing
            referenced = {x for sh in m.shards for x in (sh.path, sh.index)}
        for name in (layout.shard_name(rank, generation), layout.index_name(rank, generation)):
            if name in referenced:
                continue
            try:
                st.remove_tree(f"{sdir}/{name}")
            except (OSError, CkptError) as e:
                log.warning("could not remove %s/%s/%s: %s", st.url, sdir, name, e)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(self.lease_s, self.barrier_timeout_s) / 4))
            t = time.monotonic()
            for s in list(self.sessions.values()):
                if s.status != OPEN:
                    continue
                if s.assignment is None:
                    if t > s.barrier_deadline:
                        missing = [
                            r
                            for r in range(s.world_size)
                            if r not in s.plans or not s.plans[r].complete
                        ]
                        await self._abort(
                            s, f"ranks {_ranks(missing)} did not join within the barrier timeout"
                        )
                    continue
                silent = [
                    r
                    for r in range(s.world_size)
                    if r not in s.reports and t - s.last_seen.get(r, s.created) > self.lease_s
                ]
                if silent:
                    await self._abort(
                        s,
                        f"rank(s) {_ranks(silent)} silent for over {self.lease_s:.0f}s (lease expired; the process died or hung)",
                    )

    async def _retention(self, job: str, keep_last: int) -> None:
        committed = [r.step for r in self.catalog.saves(job, COMMITTED)]
        if len(committed) <= keep_last:
            return
        newest = committed[-1]
        # Quarantined steps older than every kept one go too (they are never loaded again).
        oldest_kept = committed[-keep_last]
        quarantined = [r.step for r in self.catalog.saves(job, QUARANTINED)]
        doomed = sorted(committed[:-keep_last] + [q for q in quarantined if q < oldest_kept])
        for step in doomed:
            if step >= newest:
                continue
            # Listed before anything is removed: a restart finishes exactly these steps.
            await self.catalog.write(
                "INSERT OR IGNORE INTO retiring (job, step) VALUES (?, ?)", (job, step)
            )
            try:
                await asyncio.to_thread(
                    recycle.retire_step,
                    self.storage(job),
                    step,
                    keep_files=knobs.get().recycle_files,
                )
            except OSError as e:
                log.warning("retention: could not remove job %s step %d: %s", job, step, e)
                continue
            # The widest window: the step is gone from storage, still listed in the catalog.
            crash_point("coordinator.during_retention")
            await self._forget_retired(job, step)

    async def _forget_retired(self, job: str, step: int) -> None:
        await self.catalog.write("DELETE FROM saves WHERE job=? AND step=?", (job, step))
        await self.catalog.write("DELETE FROM retiring WHERE job=? AND step=?", (job, step))

    # -- recovery ----------------------------------------------------------------------
    async def recover(self) -> None:
        """Finish or abort what a previous life of the coordinator left open."""
        if self.catalog.created:
            await asyncio.to_thread(self.rebuild_from_storage)
        for rec in self.catalog.saves():
            if rec.status not in (OPEN, COMMITTING):
                continue
            full = self.catalog.save(rec.job, rec.step)
            assert full is not None
            try:
                outcome = await asyncio.to_thread(self._recover_one, full)
            except (CkptError, OSError, ValueError) as e:
                outcome = (
                    ABORTED,
                    f"coordinator restarted; could not complete the save: {e}",
                    "",
                    0,
                )
            status, reason, digest, total = outcome
            await self.catalog.write(
                "UPDATE saves SET status=?, reason=?, manifest_blake3=?, bytes=?, committed_unix=?, draft=NULL "
                "WHERE job=? AND step=?",
                (
                    status,
                    reason,
                    digest,
                    total,
                    now() if status == COMMITTED else 0,
                    rec.job,
                    rec.step,
                ),
            )
            await self.catalog.write(
                "DELETE FROM reports WHERE job=? AND step=? AND generation=?",
                (rec.job, rec.step, rec.generation),
            )
            if status == ABORTED:
                await asyncio.to_thread(
                    self._remove_generation_files, rec.job, rec.step, rec.generation, rec.world_size
                )
            log.warning("recovered job %s step %d: %s %s", rec.job, rec.step, status, reason)
        await self._finish_retention()

    async def _finish_retention(self) -> None:
        """Finish what a retention run of a previous life left half done.

        Retention lists a step in the catalog's `retiring` table, removes it from storage,
        then deletes its rows; a crash in between leaves a row that calls COMMITTED a step
        whose manifest is gone. Only listed steps are retired again (idempotent): a
        committed step whose manifest vanished for any other reason is left for verify and
        load to report.
        """
        for job, step in self.catalog.retiring():
            try:
                st = self.storage(job)
                await asyncio.to_thread(
                    recycle.retire_step, st, step, keep_files=knobs.get().recycle_files
                )
                await self._forget_retired(job, step)
                log.warning("job %s step %d: finished its removal by retention", job, step)
            except (CkptError, OSError) as e:
                log.warning(
                    "job %s step %d: could not finish an interrupted retention: %s", job, step, e
                )

    def _recover_one(self, rec: SaveRecord) -> tuple[str, str, str, int]:
        st = self.storage(rec.job)
        mpath = f"{layout.step_dir(rec.step)}/{layout.MANIFEST_NAME}"
        if st.exists(mpath):
            data = st.read_bytes(mpath, limit=1 << 30)
            m = ckfmt.read_manifest(st, rec.step)
            return COMMITTED, "", hashing.digest(data), sum(s.size for s in m.shards)
        reports = self.catalog.reports(rec.job, rec.step, rec.generation)
        if rec.draft is None or len(reports) != rec.world_size:
            return (
                ABORTED,
                (
                    f"coordinator restarted during the save ({len(reports)} of {rec.world_size} shards reported)"
                ),
                "",
                0,
            )
        draft = json.loads(rec.draft)
        shards = [
            ShardInfo(
                r,
                rep["shard_path"],
                rep["size"],
                rep["index_path"],
                rep["index_size"],
                rep["index_blake3"],
            )
            for r, rep in sorted(reports.items())
        ]
        m = Manifest(
            job=rec.job,
            step=rec.step,
            generation=rec.generation,
            world_size=rec.world_size,
            block_size=_shard_block_size(st, rec.step, shards),
            alignment=4096,
            shards=shards,
            state=draft["state"],
            metadata=draft["metadata"],
        )
        data = ckfmt.commit(st, m)
        return (
            COMMITTED,
            "completed after a coordinator restart",
            hashing.digest(data),
            sum(s.size for s in shards),
        )

    def rebuild_from_storage(self) -> int:
        """Recreate catalog rows from the manifests under the root (promise 6)."""
        n = 0
        for job in _find_jobs(self.root) if not self.location.is_url else []:
            st = self._found_storage(job)
            if st is None:
                continue  # removed since the walk listed it
            gen, found = 0, 0
            for info in ckfmt.list_steps(st):
                if info.manifest is None:
                    continue
                m = info.manifest
                mpath = f"{layout.step_dir(m.step)}/{layout.MANIFEST_NAME}"
                try:
                    data = st.read_bytes(mpath, limit=1 << 30)
                except (CkptError, OSError):
                    if st.exists(mpath):
                        raise
                    continue  # the step (or its job) was removed while the scan read it
                quarantined = info.status == ckfmt.QUARANTINED
                self.catalog.execute(
                    "INSERT OR REPLACE INTO saves (job, step, generation, world_size, status, reason, bytes, "
                    "created_unix, committed_unix, manifest_blake3) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        job,
                        m.step,
                        m.generation,
                        m.world_size,
                        QUARANTINED if quarantined else COMMITTED,
                        (info.error or "") if quarantined else "",
                        sum(s.size for s in m.shards),
                        m.created_unix,
                        m.created_unix,
                        hashing.digest(data),
                    ),
                )
                gen = max(gen, m.generation)
                found += 1
            n += found
            newest = self.catalog.generation(job)
            if found and (newest is None or newest < gen):
                self.catalog.execute(
                    "INSERT OR REPLACE INTO jobs (job, generation) VALUES (?, ?)", (job, gen)
                )
                self._generations[job] = gen
        return n


def _check_step(job: str, step: int) -> None:
    try:
        layout.check_step(step)
    except ValueError as e:
        raise InvalidRequest(f"job {job!r}: {e}") from None


def _find_jobs(root: str, max_depth: int = 6) -> list[str]:
    """Directories under root that contain step-* directories (a job)."""
    jobs = []
    for dirpath, dirnames, _ in os.walk(root):
        depth = os.path.relpath(dirpath, root).count("/")
        if any(layout.parse_step_dir(d) is not None for d in dirnames):
            rel = os.path.relpath(dirpath, root)
            if rel != ".":
                jobs.append(rel)
        dirnames[:] = [
            d
            for d in dirnames
            if layout.parse_step_dir(d) is None and not d.startswith(".") and depth < max_depth
        ]
    return sorted(jobs)


def _index_block_size(doc: Any) -> int:
    try:
        return int(doc["block_size"])
    except (ValueError, KeyError, TypeError):
        raise CkptError("shard index is not a JSON object with a block_size") from None


def _shard_block_size(st: Storage, step: int, shards: list[ShardInfo]) -> int:
    sizes = set()
    for sh in shards:
        data = st.read_bytes(f"{layout.step_dir(step)}/{sh.index}", limit=sh.index_size)
        sizes.add(
            _index_block_size(load_json(data, f"{st.url}/{layout.step_dir(step)}/{sh.index}"))
        )
    if len(sizes) != 1:
        raise CkptError(
            f"step {step}: ranks used different hash block sizes {sorted(sizes)}; set CKPT_BLOCK_SIZE equally on every rank"
        )
    return sizes.pop()


def _chunks_json(chunks: dict[int, list[planning.ChunkPlan]]) -> dict[str, int]:
    return {str(r): len(c) for r, c in chunks.items()}


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (
        f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else ""
    )
