"""The coordinator's catalog: one set of semantics over two databases.

It records each job's newest generation, each save's status and, durably before a rank
is told its report was accepted, every shard report, plus the manifest draft (state and
metadata) once the plan is made. That is enough to finish, after a coordinator crash, a
save whose shards were all reported, and to abort the rest. Storage stays the source of
truth for what is committed (promise 6): `rebuild_from_storage` recreates the catalog
from manifests alone.

Every statement is here: the core records a save's life through typed methods
(`record_begin`, `record_draft`, `record_reports`, `mark_committing`, `mark_committed`,
`mark_aborted`, `mark_quarantined`, `record_tier`, `add_retiring`, `forget_retired`,
`set_generation`, and `found_job` for a rebuild), each one durable
transaction shared with whatever else is queued (group commit). The statements are
written once (catalog_sql's forms) and run by a backend: SQLite on a local disk
(catalog_sqlite, the embedded default) or PostgreSQL (catalog_pg, `ckptd serve --catalog
postgresql://...`, where a standby coordinator can take over; docs/coordinator.md).

One coordinator per catalog: two (two processes that each started an embedded coordinator
on one job, two `ckptd serve` on one root) would each believe their own generations and
recover, that is abort, each other's saves in flight. A coordinator of a SQLite catalog
holds `CatalogLock`, an flock on `<catalog>.lock`, for its life; the kernel releases it
when the process dies, so a killed coordinator never leaves it stuck. On PostgreSQL the
leader holds an advisory lock on the session that does its writes (catalog_pg).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import os
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd.coordinator.catalog_sql import (
    SCHEMA,
    SCHEMA_VERSION,
    Backend,
    CatalogError,
    CatalogUnavailable,
    InsertIgnore,
    Replace,
    Sql,
    Statement,
)
from ckptd.coordinator.catalog_sqlite import SqliteBackend
from ckptd.coordinator.types import (
    ABORTED,
    COMMITTED,
    COMMITTING,
    OPEN,
    QUARANTINED,
    TIER_REMOVED,
    ShardReport,
    StatusResult,
)
from ckptd.errors import JobInUse

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "Catalog",
    "CatalogError",
    "CatalogLock",
    "CatalogUnavailable",
    "SaveRecord",
    "TierRecord",
]


@dataclasses.dataclass
class TierRecord:
    job: str
    step: int
    tier: str
    url: str
    status: str
    reason: str = ""
    updated_unix: float = 0.0


@dataclasses.dataclass
class SaveRecord:
    job: str
    step: int
    generation: int
    world_size: int
    status: str
    reason: str = ""
    bytes: int = 0
    created_unix: float = 0.0
    committed_unix: float = 0.0
    manifest_blake3: str = ""
    draft: str | None = None
    keep_last: int = 0
    parent: int | None = None

    def answer(self) -> StatusResult:
        """What a rank asking about this save is told (as Session.answer for a live one)."""
        return StatusResult(self.status, self.reason, self.manifest_blake3)

    def draft_doc(self) -> dict[str, Any] | None:
        """The manifest's draft (`Catalog.record_draft`); None before the plan was made."""
        return None if self.draft is None else json.loads(self.draft)


class CatalogLock:
    """An exclusive flock on `<catalog>.lock`, held until `release` (or the process dies).

    The file says who holds it ("pid N on HOST"), for the error the next opener gets.
    """

    def __init__(self, catalog_path: str, *, what: str, advice: str):
        self.path = f"{catalog_path}.lock"
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise JobInUse(
                f"{what} is already open in another process ({holder}): its catalog "
                f"{catalog_path} is locked. {advice}"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None


class Catalog:
    """The catalog over a backend: `Catalog(path)` is SQLite at that path; a Backend
    instance (catalog_pg.PostgresBackend, leading) is used as it is."""

    def __init__(self, target: str | Backend, *, allow_network_fs: bool = False):
        self.backend: Backend = (
            SqliteBackend(target, allow_network_fs=allow_network_fs)
            if isinstance(target, str)
            else target
        )
        self.path = self.backend.where
        self.created = self.backend.created
        # Writes run on one thread of their own, off the event loop; reads run on the loop.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckptd-catalog")
        self._pending: list[tuple[list[Statement], str, asyncio.Future[None]]] = []
        self._flush_task: asyncio.Task[None] | None = None

    @property
    def db(self) -> Any:
        """The SQLite reader connection (for tools that read the file's pragmas); None on
        another backend."""
        return getattr(self.backend, "db", None)

    async def drain(self) -> None:
        """Wait until every queued write is durable (or has failed)."""
        while self._flush_task is not None and not self._flush_task.done():
            await asyncio.shield(self._flush_task)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.backend.close()

    # -- group commit ------------------------------------------------------------------
    async def _write(self, *statements: Statement, what: str = "") -> None:
        """Execute statements durably, in one transaction; concurrent callers share one
        transaction and one fsync. `what` (job, step) prefixes a failure's message."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((list(statements), what, fut))
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.get_running_loop().create_task(self._flush())
        await fut

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let the other requests of this tick queue up
        loop = asyncio.get_running_loop()
        while self._pending:
            # Writes arriving while this batch is being made durable form the next batch:
            # under load one fsync covers many reports.
            batch, self._pending = self._pending, []
            try:
                await loop.run_in_executor(
                    self._writer, self._commit, [st for sts, _, _ in batch for st in sts]
                )
            except CatalogError as e:
                for _, what, fut in batch:
                    if not fut.done():
                        fut.set_exception(_named(e, what))
                continue
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_result(None)

    def _commit(self, batch: Sequence[Statement]) -> None:
        self.backend.transact(batch)

    # -- writes: a save's life ---------------------------------------------------------
    async def record_attempt(self, job: str, attempt: str, generation: int) -> None:
        await self._write(
            Sql(
                "INSERT INTO attempts (job, attempt, generation) VALUES (?, ?, ?)",
                (job, attempt, generation),
            ),
            what=f"job {job!r} attempt {attempt!r}",
        )

    async def set_generation(self, job: str, generation: int) -> None:
        """The job's newest generation (fencing: older ones are refused from now on)."""
        await self._write(_set_generation(job, generation), what=f"job {job!r}")

    async def record_begin(
        self,
        job: str,
        step: int,
        generation: int,
        world_size: int,
        keep_last: int = 0,
        parent: int | None = None,
    ) -> None:
        """A new save, OPEN (replacing an earlier generation's row of the step)."""
        await self._write(
            Replace(
                "saves",
                ("job", "step"),
                dict(
                    job=job,
                    step=step,
                    generation=generation,
                    world_size=world_size,
                    status=OPEN,
                    created_unix=now(),
                    keep_last=keep_last,
                    parent=parent,
                ),
            ),
            what=_what(job, step),
        )

    async def record_draft(
        self, job: str, step: int, generation: int, draft: dict[str, Any]
    ) -> None:
        """The manifest's draft (merged state, metadata), once the plan is made."""
        await self._write(
            Sql(
                "UPDATE saves SET draft=? WHERE job=? AND step=? AND generation=?",
                (json.dumps(draft), job, step, generation),
            ),
            what=_what(job, step),
        )

    async def record_reports(self, rows: Sequence[tuple[str, int, int, int, ShardReport]]) -> None:
        """Checked shard reports (job, step, generation, rank, report), durable before
        their ranks are told they were accepted: a node's reports in one transaction and
        one row per save among them (a rank's report, if re-sent, is equal: see
        Reports._admit_report, so overlapping rows of a retried batch agree)."""
        batches: dict[tuple[str, int, int], list[tuple[int, ShardReport]]] = {}
        for job, step, gen, rank, rep in rows:
            batches.setdefault((job, step, gen), []).append((rank, rep))
        if batches:
            (job, step, _), *_ = batches
            await self._write(
                *(
                    Replace(
                        "batch_reports",
                        ("job", "step", "generation", "first_rank"),
                        dict(
                            job=save[0],
                            step=save[1],
                            generation=save[2],
                            first_rank=min(r for r, _ in got),
                            reports=_reports_json(got),
                        ),
                    )
                    for save, got in batches.items()
                ),
                what=_what(job, step) + " (shard reports)",
            )

    async def mark_committing(self, job: str, step: int, generation: int) -> None:
        await self._write(
            Sql(
                "UPDATE saves SET status=? WHERE job=? AND step=? AND generation=?",
                (COMMITTING, job, step, generation),
            ),
            what=_what(job, step),
        )

    async def mark_committed(
        self,
        job: str,
        step: int,
        generation: int,
        manifest_blake3: str,
        nbytes: int,
        reason: str = "",
    ) -> float:
        """The manifest is written: COMMITTED; the draft and the reports are done with.
        Returns the commit time recorded (the record's committed_unix)."""
        at = now()
        await self._write(
            Sql(
                "UPDATE saves SET status=?, reason=?, committed_unix=?, manifest_blake3=?, "
                "bytes=?, draft=NULL WHERE job=? AND step=? AND generation=?",
                (COMMITTED, reason, at, manifest_blake3, nbytes, job, step, generation),
            ),
            *_forget_reports(job, step, generation),
            what=_what(job, step),
        )
        return at

    async def mark_aborted(self, job: str, step: int, generation: int, reason: str) -> None:
        await self._write(
            Sql(
                "UPDATE saves SET status=?, reason=?, draft=NULL "
                "WHERE job=? AND step=? AND generation=?",
                (ABORTED, reason[:4000], job, step, generation),
            ),
            *_forget_reports(job, step, generation),
            what=_what(job, step),
        )

    async def mark_quarantined(self, job: str, step: int, reason: str) -> None:
        await self._write(
            Sql(
                "UPDATE saves SET status=?, reason=? WHERE job=? AND step=?",
                (QUARANTINED, reason, job, step),
            ),
            what=_what(job, step),
        )

    # -- writes: tiers and retention ---------------------------------------------------
    async def record_tier(
        self, job: str, step: int, tier: str, url: str, status: str, reason: str = ""
    ) -> None:
        """What a tier holds of a step; REMOVED deletes the row."""
        what = f"{_what(job, step)} tier {tier!r}"
        if status == TIER_REMOVED:
            await self._write(
                Sql("DELETE FROM tiers WHERE job=? AND step=? AND tier=?", (job, step, tier)),
                what=what,
            )
            return
        await self._write(
            Replace(
                "tiers",
                ("job", "step", "tier"),
                dict(
                    job=job,
                    step=step,
                    tier=tier,
                    url=url,
                    status=status,
                    reason=reason[:4000],
                    updated_unix=now(),
                ),
            ),
            what=what,
        )

    async def add_retiring(self, job: str, step: int) -> None:
        """Listed before retention removes anything of the step: a restart finishes it."""
        await self._write(InsertIgnore("retiring", dict(job=job, step=step)), what=_what(job, step))

    async def forget_retired(self, job: str, step: int) -> None:
        """The step is gone from storage: its rows go, in one transaction."""
        await self._write(
            Sql("DELETE FROM saves WHERE job=? AND step=?", (job, step)),
            Sql("DELETE FROM retiring WHERE job=? AND step=?", (job, step)),
            what=_what(job, step),
        )

    # -- writes: a rebuild from storage (synchronous; no write may be in flight) --------
    def found_job(self, job: str, saves: list[SaveRecord], generation: int | None) -> None:
        """A job found on storage: its steps as storage describes them and, when newer than
        the catalog's, its newest generation, in one transaction (a job of 10,000 steps
        costs one fsync, not 10,000)."""
        try:
            self._commit(
                [
                    Replace(
                        "saves",
                        ("job", "step"),
                        dict(
                            job=rec.job,
                            step=rec.step,
                            generation=rec.generation,
                            world_size=rec.world_size,
                            status=rec.status,
                            reason=rec.reason,
                            bytes=rec.bytes,
                            created_unix=rec.created_unix,
                            committed_unix=rec.committed_unix,
                            manifest_blake3=rec.manifest_blake3,
                            parent=rec.parent,
                        ),
                    )
                    for rec in saves
                ]
                + ([_set_generation(job, generation)] if generation is not None else [])
            )
        except CatalogError as e:
            raise _named(e, f"job {job!r} (rebuilding its rows from storage)") from None

    # -- queries -----------------------------------------------------------------------
    def generation(self, job: str) -> int | None:
        rows = self.backend.query("SELECT generation FROM jobs WHERE job=?", (job,))
        return None if not rows else int(rows[0][0])

    def attempt_generation(self, job: str, attempt: str) -> int | None:
        rows = self.backend.query(
            "SELECT generation FROM attempts WHERE job=? AND attempt=?", (job, attempt)
        )
        return None if not rows else int(rows[0][0])

    def save(self, job: str, step: int) -> SaveRecord | None:
        rows = self.backend.query(
            "SELECT job, step, generation, world_size, status, reason, bytes, created_unix, "
            "committed_unix, manifest_blake3, draft, keep_last, parent FROM saves "
            "WHERE job=? AND step=?",
            (job, step),
        )
        return None if not rows else SaveRecord(*rows[0])

    def saves(self, job: str | None = None, status: str | None = None) -> list[SaveRecord]:
        sql = (
            "SELECT job, step, generation, world_size, status, reason, bytes, created_unix, "
            "committed_unix, manifest_blake3, NULL, keep_last, parent FROM saves"
        )
        cond, args = [], []
        if job is not None:
            cond.append("job=?")
            args.append(job)
        if status is not None:
            cond.append("status=?")
            args.append(status)
        if cond:
            sql += " WHERE " + " AND ".join(cond)
        sql += " ORDER BY job, step"
        return [SaveRecord(*r) for r in self.backend.query(sql, args)]

    def jobs(self) -> list[str]:
        rows = self.backend.query("SELECT DISTINCT job FROM saves UNION SELECT job FROM jobs")
        return sorted(r[0] for r in rows)

    def retiring(self) -> list[tuple[str, int]]:
        """(job, step) of each step a retention run began to remove and did not finish."""
        rows = self.backend.query("SELECT job, step FROM retiring ORDER BY job, step")
        return [(job, step) for job, step in rows]

    def tiers(self, job: str) -> list[TierRecord]:
        rows = self.backend.query(
            "SELECT job, step, tier, url, status, reason, updated_unix FROM tiers WHERE job=? "
            "ORDER BY step, tier",
            (job,),
        )
        return [TierRecord(*r) for r in rows]

    def reports(self, job: str, step: int, generation: int) -> dict[int, ShardReport]:
        save = (job, step, generation)
        out = {
            int(r): ShardReport(**json.loads(rep))
            for r, rep in self.backend.query(
                "SELECT rank, report FROM reports WHERE job=? AND step=? AND generation=?", save
            )
        }
        for (batch,) in self.backend.query(
            "SELECT reports FROM batch_reports WHERE job=? AND step=? AND generation=? "
            "ORDER BY first_rank",
            save,
        ):
            out.update((int(r), ShardReport(**rep)) for r, rep in json.loads(batch))
        return out


def now() -> float:
    return time.time()


_REPORT_FIELDS = tuple(f.name for f in dataclasses.fields(ShardReport))


def _what(job: str, step: int) -> str:
    return f"job {job!r} step {step}"


def _named(e: CatalogError, what: str) -> CatalogError:
    """The failure with the save it was recording named first (same class: an unreachable
    catalog stays CatalogUnavailable, answered UNAVAILABLE)."""
    if not what:
        return e
    return type(e)(f"{what}: {e}")


def _set_generation(job: str, generation: int) -> Replace:
    return Replace("jobs", ("job",), dict(job=job, generation=generation))


def _reports_json(reports: Sequence[tuple[int, ShardReport]]) -> str:
    """A batch's row (what `reports` reads back); flat, so no dataclasses.asdict walk."""
    return json.dumps([[r, {f: getattr(rep, f) for f in _REPORT_FIELDS}] for r, rep in reports])


def _forget_reports(job: str, step: int, generation: int) -> list[Statement]:
    save = (job, step, generation)
    return [
        Sql("DELETE FROM reports WHERE job=? AND step=? AND generation=?", save),
        Sql("DELETE FROM batch_reports WHERE job=? AND step=? AND generation=?", save),
    ]
