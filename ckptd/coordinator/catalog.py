"""The coordinator's catalog: SQLite (WAL, synchronous=FULL) on a local disk.

It records each job's newest generation, each save's status and, durably before a rank
is told its report was accepted, every shard report, plus the manifest draft (state and
metadata) once the plan is made. That is enough to finish, after a coordinator crash, a
save whose shards were all reported, and to abort the rest. Storage stays the source of
truth for what is committed (promise 6): `rebuild_from_storage` recreates the catalog
from manifests alone.

SQLite's locking is not safe on NFS/Lustre/other network filesystems, so opening a
catalog there is refused unless explicitly allowed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd.errors import CkptError
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
SCHEMA_VERSION = 3


def migrate(db: sqlite3.Connection) -> None:
    """Bring a catalog to SCHEMA_VERSION; additive only, so older readers still work."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version < 2:
        db.executescript(TIERS_SCHEMA)
    if version < 3:
        db.executescript(RETIRING_SCHEMA)
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


class Catalog:
    def __init__(self, path: str, *, allow_network_fs: bool = False):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if not allow_network_fs:
            check_local(path)
        self.created = not os.path.exists(path)
        # Two connections: writes (and their fsyncs) run on one thread of their own, off
        # the event loop; reads run on the loop against the other (WAL lets them proceed).
        self._wdb = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._wdb.execute("PRAGMA journal_mode=WAL")
        self._wdb.execute("PRAGMA synchronous=FULL")
        self._wdb.executescript(SCHEMA)
        migrate(self._wdb)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckptd-catalog")
        self._pending: list[tuple[str, tuple[Any, ...], asyncio.Future[None]]] = []
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
    async def write(self, sql: str, args: tuple[Any, ...]) -> None:
        """Execute one statement durably; concurrent callers share one transaction/fsync."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((sql, args, fut))
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
                    self._writer, self._commit, [(q, a) for q, a, _ in batch]
                )
            except sqlite3.Error as e:
                err = CatalogError(f"catalog {self.path}: write failed: {e}")
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            for _, _, fut in batch:
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

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> None:
        """Synchronous single statement (startup, recovery; no write may be in flight)."""
        self._wdb.execute(sql, args)

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
            "committed_unix, manifest_blake3, draft, keep_last FROM saves WHERE job=? AND step=?",
            (job, step),
        ).fetchone()
        return None if row is None else SaveRecord(*row)

    def saves(self, job: str | None = None, status: str | None = None) -> list[SaveRecord]:
        sql = (
            "SELECT job, step, generation, world_size, status, reason, bytes, created_unix, "
            "committed_unix, manifest_blake3, NULL, keep_last FROM saves"
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

    def reports(self, job: str, step: int, generation: int) -> dict[int, dict[str, Any]]:
        rows = self.db.execute(
            "SELECT rank, report FROM reports WHERE job=? AND step=? AND generation=?",
            (job, step, generation),
        ).fetchall()
        return {int(r): json.loads(rep) for r, rep in rows}


def now() -> float:
    return time.time()
