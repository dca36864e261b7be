"""The coordinator's catalog: SQLite (WAL, synchronous=FULL) on a local disk.

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
transaction shared with whatever else is queued (group commit).

SQLite's locking is not safe on NFS/Lustre/other network filesystems, so opening a
catalog there is refused unless explicitly allowed.

One coordinator per catalog: two (two processes that each started an embedded coordinator
on one job, two `ckptd serve` on one root) would each believe their own generations and
recover, that is abort, each other's saves in flight. A coordinator holds `CatalogLock`,
an flock on `<catalog>.lock`, for its life; the kernel releases it when the process dies,
so a killed coordinator never leaves it stuck.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import os
import socket
import sqlite3
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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
from ckptd.errors import CkptError, JobInUse
from ckptd.storage.location import NETWORK_FS, filesystem_type

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job TEXT PRIMARY KEY,
    generation INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS saves (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    world_size INTEGER NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    bytes INTEGER NOT NULL DEFAULT 0,
    created_unix REAL NOT NULL,
    committed_unix REAL NOT NULL DEFAULT 0,
    manifest_blake3 TEXT NOT NULL DEFAULT '',
    draft TEXT,
    keep_last INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job, step)
);
CREATE TABLE IF NOT EXISTS attempts (
    job TEXT NOT NULL,
    attempt TEXT NOT NULL,
    generation INTEGER NOT NULL,
    PRIMARY KEY (job, attempt)
);
CREATE TABLE IF NOT EXISTS reports (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    report TEXT NOT NULL,
    PRIMARY KEY (job, step, generation, rank)
);
"""

# Schema 2: the tiers that hold each step besides the job's directory (the "local" tier,
# whose state is the saves table): a mirror's copy is UPLOADING, HELD (verified and
# committed there) or FAILED (reason says why); retention in the mirror deletes the row.
# A new table, so the migration of a schema-1 catalog is creating it (`migrate`).
TIERS_SCHEMA = """
CREATE TABLE IF NOT EXISTS tiers (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    tier TEXT NOT NULL,
    url TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    updated_unix REAL NOT NULL,
    PRIMARY KEY (job, step, tier)
);
"""
# Schema 3: steps retention has begun to remove. Retention lists a step here, removes it
# from storage, then deletes its rows; a restarted coordinator finishes exactly what is
# listed. A committed step whose manifest vanished otherwise is damage to report, never
# debris to delete.
RETIRING_SCHEMA = """
CREATE TABLE IF NOT EXISTS retiring (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    PRIMARY KEY (job, step)
);
"""
# Schema 4: each save's parent, the step its state descends from (NULL: not recorded), so
# retention follows the job's live line (docs/concepts.md, Rollbacks and the live line).
# Schema 5: shard reports one row a batch (a node's, or one rank's), keyed by the batch's
# first rank, its reports a JSON list of [rank, report]: rows grow with nodes, not ranks.
# Rows of the per-rank `reports` table (schema 1-4, a save in flight across an upgrade)
# are still read; nothing writes them now.
BATCH_REPORTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS batch_reports (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    first_rank INTEGER NOT NULL,
    reports TEXT NOT NULL,
    PRIMARY KEY (job, step, generation, first_rank)
);
"""
SCHEMA_VERSION = 5


def migrate(db: sqlite3.Connection) -> None:
    """Bring a catalog to SCHEMA_VERSION; additive only, so older readers still work."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version < 2:
        db.executescript(TIERS_SCHEMA)
    if version < 3:
        db.executescript(RETIRING_SCHEMA)
    if version < 4:
        columns = {row[1] for row in db.execute("PRAGMA table_info(saves)")}
        if "parent" not in columns:
            db.execute("ALTER TABLE saves ADD COLUMN parent INTEGER")
    if version < 5:
        db.executescript(BATCH_REPORTS_SCHEMA)
    if version < SCHEMA_VERSION:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")


@dataclasses.dataclass
class TierRecord:
    job: str
    step: int
    tier: str
    url: str
    status: str
    reason: str = ""
    updated_unix: float = 0.0


class CatalogError(CkptError):
    pass


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


def check_local(path: str) -> None:
    d = path if os.path.isdir(path) else os.path.dirname(path) or "."
    fstype = filesystem_type(d)
    if fstype in NETWORK_FS:
        raise CatalogError(
            f"the catalog {path} would live on a {fstype} filesystem; SQLite's locking and WAL "
            "are not safe there. Put it on a local disk (ckptd serve --catalog /local/path, or "
            "CKPTD_CATALOG_DIR for the embedded coordinator), or pass --allow-network-catalog "
            "if only one coordinator will ever open it"
        )


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
    def __init__(self, path: str, *, allow_network_fs: bool = False):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if not allow_network_fs:
            check_local(path)
        self.created = not os.path.exists(path)
        try:
            # Two connections: writes (and their fsyncs) run on one thread of their own, off
            # the event loop; reads run on the loop against the other (WAL lets them proceed).
            self._wdb = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._wdb.execute("PRAGMA journal_mode=WAL")
            self._wdb.execute("PRAGMA synchronous=FULL")
            self._wdb.executescript(SCHEMA)
            migrate(self._wdb)
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise CatalogError(
                f"cannot open the catalog {path}: {e}; it must be a writable file on a local "
                "disk (ckptd serve --catalog PATH, or CKPTD_CATALOG_DIR for the embedded "
                "coordinator)"
            ) from e
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckptd-catalog")
        self._pending: list[tuple[list[tuple[str, tuple[Any, ...]]], asyncio.Future[None]]] = []
        self._flush_task: asyncio.Task[None] | None = None

    async def drain(self) -> None:
        """Wait until every queued write is durable (or has failed)."""
        while self._flush_task is not None and not self._flush_task.done():
            await asyncio.shield(self._flush_task)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.db.close()
        self._wdb.close()

    # -- group commit ------------------------------------------------------------------
    async def _write(self, *statements: tuple[str, tuple[Any, ...]]) -> None:
        """Execute statements durably, in one transaction; concurrent callers share one
        transaction and one fsync."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((list(statements), fut))
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
                    self._writer, self._commit, [st for sts, _ in batch for st in sts]
                )
            except sqlite3.Error as e:
                err = CatalogError(f"catalog {self.path}: write failed: {e}")
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            for _, fut in batch:
                if not fut.done():
                    fut.set_result(None)

    def _commit(self, batch: list[tuple[str, tuple[Any, ...]]]) -> None:
        try:
            self._wdb.execute("BEGIN IMMEDIATE")
            for sql, args in batch:
                self._wdb.execute(sql, args)
            self._wdb.execute("COMMIT")
        except sqlite3.Error:
            try:
                self._wdb.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise

    # -- writes: a save's life ---------------------------------------------------------
    async def record_attempt(self, job: str, attempt: str, generation: int) -> None:
        await self._write(
            (
                "INSERT INTO attempts (job, attempt, generation) VALUES (?, ?, ?)",
                (job, attempt, generation),
            )
        )

    async def set_generation(self, job: str, generation: int) -> None:
        """The job's newest generation (fencing: older ones are refused from now on)."""
        await self._write((_SET_GENERATION, (job, generation)))

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
            (
                "INSERT OR REPLACE INTO saves (job, step, generation, world_size, status, "
                "created_unix, keep_last, parent) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (job, step, generation, world_size, OPEN, now(), keep_last, parent),
            )
        )

    async def record_draft(
        self, job: str, step: int, generation: int, draft: dict[str, Any]
    ) -> None:
        """The manifest's draft (merged state, metadata), once the plan is made."""
        await self._write(
            (
                "UPDATE saves SET draft=? WHERE job=? AND step=? AND generation=?",
                (json.dumps(draft), job, step, generation),
            )
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
            await self._write(
                *(
                    (_RECORD_BATCH, (*save, min(r for r, _ in got), _reports_json(got)))
                    for save, got in batches.items()
                )
            )

    async def mark_committing(self, job: str, step: int, generation: int) -> None:
        await self._write(
            (
                "UPDATE saves SET status=? WHERE job=? AND step=? AND generation=?",
                (COMMITTING, job, step, generation),
            )
        )

    async def mark_committed(
        self,
        job: str,
        step: int,
        generation: int,
        manifest_blake3: str,
        nbytes: int,
        reason: str = "",
    ) -> None:
        """The manifest is written: COMMITTED; the draft and the reports are done with."""
        await self._write(
            (
                "UPDATE saves SET status=?, reason=?, committed_unix=?, manifest_blake3=?, "
                "bytes=?, draft=NULL WHERE job=? AND step=? AND generation=?",
                (COMMITTED, reason, now(), manifest_blake3, nbytes, job, step, generation),
            ),
            *_forget_reports(job, step, generation),
        )

    async def mark_aborted(self, job: str, step: int, generation: int, reason: str) -> None:
        await self._write(
            (
                "UPDATE saves SET status=?, reason=?, draft=NULL "
                "WHERE job=? AND step=? AND generation=?",
                (ABORTED, reason[:4000], job, step, generation),
            ),
            *_forget_reports(job, step, generation),
        )

    async def mark_quarantined(self, job: str, step: int, reason: str) -> None:
        await self._write(
            (
                "UPDATE saves SET status=?, reason=? WHERE job=? AND step=?",
                (QUARANTINED, reason, job, step),
            )
        )

    # -- writes: tiers and retention ---------------------------------------------------
    async def record_tier(
        self, job: str, step: int, tier: str, url: str, status: str, reason: str = ""
    ) -> None:
        """What a tier holds of a step; REMOVED deletes the row."""
        if status == TIER_REMOVED:
            await self._write(
                ("DELETE FROM tiers WHERE job=? AND step=? AND tier=?", (job, step, tier))
            )
            return
        await self._write(
            (
                "INSERT OR REPLACE INTO tiers (job, step, tier, url, status, reason, "
                "updated_unix) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (job, step, tier, url, status, reason[:4000], now()),
            )
        )

    async def add_retiring(self, job: str, step: int) -> None:
        """Listed before retention removes anything of the step: a restart finishes it."""
        await self._write(("INSERT OR IGNORE INTO retiring (job, step) VALUES (?, ?)", (job, step)))

    async def forget_retired(self, job: str, step: int) -> None:
        """The step is gone from storage: its rows go, in one transaction."""
        await self._write(
            ("DELETE FROM saves WHERE job=? AND step=?", (job, step)),
            ("DELETE FROM retiring WHERE job=? AND step=?", (job, step)),
        )

    # -- writes: a rebuild from storage (synchronous; no write may be in flight) --------
    def found_job(self, job: str, saves: list[SaveRecord], generation: int | None) -> None:
        """A job found on storage: its steps as storage describes them and, when newer than
        the catalog's, its newest generation, in one transaction (a job of 10,000 steps
        costs one fsync, not 10,000)."""
        self._commit(
            [
                (
                    "INSERT OR REPLACE INTO saves (job, step, generation, world_size, status, "
                    "reason, bytes, created_unix, committed_unix, manifest_blake3, parent) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        rec.job,
                        rec.step,
                        rec.generation,
                        rec.world_size,
                        rec.status,
                        rec.reason,
                        rec.bytes,
                        rec.created_unix,
                        rec.committed_unix,
                        rec.manifest_blake3,
                        rec.parent,
                    ),
                )
                for rec in saves
            ]
            + ([(_SET_GENERATION, (job, generation))] if generation is not None else [])
        )

    # -- queries -----------------------------------------------------------------------
    def generation(self, job: str) -> int | None:
        row = self.db.execute("SELECT generation FROM jobs WHERE job=?", (job,)).fetchone()
        return None if row is None else int(row[0])

    def attempt_generation(self, job: str, attempt: str) -> int | None:
        row = self.db.execute(
            "SELECT generation FROM attempts WHERE job=? AND attempt=?", (job, attempt)
        ).fetchone()
        return None if row is None else int(row[0])

    def save(self, job: str, step: int) -> SaveRecord | None:
        row = self.db.execute(
            "SELECT job, step, generation, world_size, status, reason, bytes, created_unix, "
            "committed_unix, manifest_blake3, draft, keep_last, parent FROM saves "
            "WHERE job=? AND step=?",
            (job, step),
        ).fetchone()
        return None if row is None else SaveRecord(*row)

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
        return [SaveRecord(*r) for r in self.db.execute(sql, args).fetchall()]

    def jobs(self) -> list[str]:
        rows = self.db.execute(
            "SELECT DISTINCT job FROM saves UNION SELECT job FROM jobs"
        ).fetchall()
        return sorted(r[0] for r in rows)

    def retiring(self) -> list[tuple[str, int]]:
        """(job, step) of each step a retention run began to remove and did not finish."""
        rows = self.db.execute("SELECT job, step FROM retiring ORDER BY job, step").fetchall()
        return [(job, step) for job, step in rows]

    def tiers(self, job: str) -> list[TierRecord]:
        rows = self.db.execute(
            "SELECT job, step, tier, url, status, reason, updated_unix FROM tiers WHERE job=? "
            "ORDER BY step, tier",
            (job,),
        ).fetchall()
        return [TierRecord(*r) for r in rows]

    def reports(self, job: str, step: int, generation: int) -> dict[int, ShardReport]:
        save = (job, step, generation)
        out = {
            int(r): ShardReport(**json.loads(rep))
            for r, rep in self.db.execute(
                "SELECT rank, report FROM reports WHERE job=? AND step=? AND generation=?", save
            )
        }
        for (batch,) in self.db.execute(
            "SELECT reports FROM batch_reports WHERE job=? AND step=? AND generation=?", save
        ):
            out.update((int(r), ShardReport(**rep)) for r, rep in json.loads(batch))
        return out


def now() -> float:
    return time.time()


_SET_GENERATION = "INSERT OR REPLACE INTO jobs (job, generation) VALUES (?, ?)"
_RECORD_BATCH = (
    "INSERT OR REPLACE INTO batch_reports (job, step, generation, first_rank, reports) "
    "VALUES (?, ?, ?, ?, ?)"
)
_REPORT_FIELDS = tuple(f.name for f in dataclasses.fields(ShardReport))


def _reports_json(reports: Sequence[tuple[int, ShardReport]]) -> str:
    """A batch's row (what `reports` reads back); flat, so no dataclasses.asdict walk."""
    return json.dumps([[r, {f: getattr(rep, f) for f in _REPORT_FIELDS}] for r, rep in reports])


def _forget_reports(job: str, step: int, generation: int) -> list[tuple[str, tuple[Any, ...]]]:
    save = (job, step, generation)
    return [
        ("DELETE FROM reports WHERE job=? AND step=? AND generation=?", save),
        ("DELETE FROM batch_reports WHERE job=? AND step=? AND generation=?", save),
    ]
