"""Recovery: what a coordinator does when it starts, before it answers anyone.

A previous life may have left saves open (finished when every shard was durably reported,
aborted otherwise), a retention run half done (finished for exactly the steps listed in
`retiring`), or no catalog at all (rebuilt from the manifests in storage, promise 6: the
one job's directory for a coordinator of one job, every job under the root for `ckptd
serve`, which reports and skips what it cannot read instead of failing to start).
The Coordinator inherits these as `recover()` and `rebuild_from_storage()`; they need of it
only its root, its catalog and a job's storage, declared below.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import stat
from collections.abc import Callable, Iterable

from ckptd.coordinator import retention, session
from ckptd.coordinator.catalog import Catalog, SaveRecord
from ckptd.coordinator.types import ABORTED, COMMITTED, COMMITTING, OPEN, QUARANTINED
from ckptd.errors import CkptError
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, layout
from ckptd.storage import JobLocation, Storage

log = logging.getLogger("ckptd.coordinator")

# Bounds on a scan of the root: directories listed, and what it left out that is logged
# and kept to show (the rest are counted).
MAX_SCAN_DIRS = 100_000
MAX_SKIPPED_LISTED = 100


class Recovery:
    """Start-up recovery and catalog rebuild, mixed into the Coordinator."""

    root: str
    location: JobLocation
    catalog: Catalog
    scope: str | None
    skipped: list[Skipped]
    skipped_count: int
    skipped_paths: set[str]
    _generations: dict[str, int | None]

    def storage(self, job: str) -> Storage:
        raise NotImplementedError

    def _found_storage(self, job: str) -> Storage | None:
        raise NotImplementedError

    def _remove_files(
        self, job: str, step: int, generation: int, ranks: Iterable[int], idle: bool = False
    ) -> None:
        raise NotImplementedError

    async def recover(self) -> None:
        """Finish or abort what a previous life of the coordinator left open."""
        if self.catalog.created:
            await asyncio.to_thread(self.rebuild_from_storage)
        for rec in self.catalog.saves():
            if rec.status not in (OPEN, COMMITTING) or self.scope not in (None, rec.job):
                continue  # (a catalog written before scopes may list a neighbour's rows)
            full = self.catalog.save(rec.job, rec.step)
            assert full is not None
            try:
                status, reason, digest, total = await asyncio.to_thread(self._recover_one, full)
            except (CkptError, OSError, ValueError) as e:
                status, reason = ABORTED, f"coordinator restarted; could not complete the save: {e}"
                digest, total = "", 0
            if status == COMMITTED:
                await self.catalog.mark_committed(
                    rec.job, rec.step, rec.generation, digest, total, reason
                )
            else:
                await self.catalog.mark_aborted(rec.job, rec.step, rec.generation, reason)
                await asyncio.to_thread(
                    self._remove_files, rec.job, rec.step, rec.generation, range(rec.world_size)
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
                await asyncio.to_thread(retention.retire, self.storage(job), step)
                await self.catalog.forget_retired(job, step)
                log.warning("job %s step %d: finished its removal by retention", job, step)
            except (CkptError, OSError) as e:
                log.warning(
                    "job %s step %d: could not finish an interrupted retention: %s", job, step, e
                )

    def _recover_one(self, rec: SaveRecord) -> tuple[str, str, str, int]:
        """(status, reason, manifest blake3, bytes) of a save a previous life left open."""
        st = self.storage(rec.job)
        mpath = f"{layout.step_dir(rec.step)}/{layout.MANIFEST_NAME}"
        if st.exists(mpath):
            data = st.read_bytes(mpath, limit=1 << 30)
            m = ckfmt.read_manifest(st, rec.step)
            return COMMITTED, "", hashing.digest(data), sum(s.size for s in m.shards)
        reports = self.catalog.reports(rec.job, rec.step, rec.generation)
        draft = rec.draft_doc()
        if draft is None or len(reports) != rec.world_size:
            return (
                ABORTED,
                (
                    f"coordinator restarted during the save ({len(reports)} of {rec.world_size} shards reported)"
                ),
                "",
                0,
            )
        block_size = session.reported_block_size(st, rec.step, reports)
        m = session.manifest_of(rec, block_size, reports, draft["state"], draft["metadata"])
        data = ckfmt.commit(st, m)
        return (
            COMMITTED,
            "completed after a coordinator restart",
            hashing.digest(data),
            sum(s.size for s in m.shards),
        )

    def rebuild_from_storage(self) -> int:
        """Recreate catalog rows from the manifests in storage (promise 6); the number of
        steps found.

        A coordinator of one job (the embedded one, `scope`) reads that job's directory
        alone: a job never reads its neighbours, and its start-up does not grow with them.
        One over a root (`ckptd serve`) walks it for jobs (`_find_jobs`); a job or step it
        cannot read, or will not follow (a symlink out of the root, a loop, a corrupt
        manifest), is logged and listed in `skipped`, and the rest are served. (A step of
        its own that one job cannot read is logged too; its job it cannot read raises.)
        """
        if self.location.is_url:
            return 0
        self.skipped.clear()
        self.skipped_paths.clear()
        self.skipped_count = 0
        jobs = [self.scope] if self.scope is not None else _find_jobs(self.root, self._skip)
        n = 0
        for job in jobs:
            try:
                n += self._rebuild_job(job)
            except (CkptError, OSError, ValueError) as e:
                if self.scope is not None:
                    raise  # the one job it serves: its own user must hear, not a log line
                self._skip(
                    os.path.join(self.root, job),
                    f"its checkpoints could not be read: {e}",
                    "fix or move the directory, then run `ckptd rebuild-catalog` to list it",
                )
        return n

    def _rebuild_job(self, job: str) -> int:
        st = self._found_storage(job)
        if st is None:
            return 0  # removed since the walk listed it
        gen, found = 0, []
        for info in ckfmt.list_steps(st):
            if info.manifest is None:
                if info.status == ckfmt.INVALID:
                    self._skip(
                        os.path.join(self.root, job, layout.step_dir(info.step)),
                        info.error or "invalid",
                        "run `ckptctl verify` on it, then repair or remove the step",
                    )
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
            found.append(
                SaveRecord(
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
                    parent=m.parent,
                )
            )
            gen = max(gen, m.generation)
        newest = self.catalog.generation(job)
        newer = found and (newest is None or newest < gen)
        self.catalog.found_job(job, found, gen if newer else None)
        if newer:
            self._generations[job] = gen
        return len(found)

    def _skip(self, path: str, reason: str, advice: str) -> None:
        """Report a job (or step, or directory) the scan could not read and left out, once
        (a step linked in a loop is met by the walk and again by the job's listing)."""
        if path in self.skipped_paths:
            return
        self.skipped_paths.add(path)
        # The first ones in full; a hostile tree of 10,000 bad steps logs a summary, not
        # 10,000 lines (serve logs the count once the scan is done).
        level = logging.WARNING if self.skipped_count < MAX_SKIPPED_LISTED else logging.DEBUG
        log.log(level, "skipped %s: %s; %s", path, reason, advice)
        if len(self.skipped) < MAX_SKIPPED_LISTED:
            self.skipped.append(Skipped(path, reason, advice))
        self.skipped_count += 1


@dataclasses.dataclass(frozen=True)
class Skipped:
    """What a scan of the root left out: the path, why, and what an operator can do."""

    path: str
    reason: str
    advice: str


def _find_jobs(
    root: str,
    skip: Callable[[str, str, str], None],
    *,
    max_depth: int = 6,
    max_dirs: int = MAX_SCAN_DIRS,
) -> list[str]:
    """Directories under root that contain step-* entries (a job), relative to it.

    Bounded: at most `max_dirs` directories are listed, none more than `max_depth` + 1
    below the root, and no step, hidden or symlinked directory is entered (a symlink is
    never followed: a loop or a link out of the root is reported, not walked). A directory
    that cannot be listed is reported and the walk goes on.
    """
    jobs: list[str] = []
    stack: list[tuple[str, int]] = [("", 0)]
    listed = 0
    while stack:
        rel, depth = stack.pop()
        if listed >= max_dirs:
            skip(
                root,
                f"the scan stopped after listing {max_dirs} directories below it; jobs "
                "beyond those are served, but the steps they hold are not in the catalog",
                "move unrelated trees out of the root, or serve a narrower --root",
            )
            break
        listed += 1
        path = os.path.join(root, rel) if rel else root
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except OSError as e:
            skip(
                path,
                f"cannot be listed ({e.strerror or e})",
                "give the user running ckptd read and execute permission on it, or move "
                "it out of the root",
            )
            continue
        is_job = False
        for entry in entries:
            linked = entry.is_symlink()
            if layout.parse_step_dir(entry.name) is not None and (
                linked or entry.is_dir(follow_symlinks=False)
            ):
                is_job = True  # a step linked out of the job: its rebuild reports it
                if linked:
                    _report_link(root, entry.path, skip, loops_only=True)
                continue
            if entry.name.startswith("."):
                continue
            if linked:
                _report_link(root, entry.path, skip)
            elif depth <= max_depth and entry.is_dir(follow_symlinks=False):
                stack.append((os.path.join(rel, entry.name) if rel else entry.name, depth + 1))
        if is_job and rel:
            jobs.append(rel)
    return sorted(jobs)


def _report_link(
    root: str, path: str, skip: Callable[[str, str, str], None], *, loops_only: bool = False
) -> None:
    """Report a symlink the walk does not follow when it may hide a job: a loop, or a
    directory outside the root (one inside it is walked where it really is)."""
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            skip(path, "is a symlink loop", "remove the link")
        return  # a dangling link holds nothing
    real = os.path.realpath(path)
    if is_dir and not loops_only and not (real + "/").startswith(root.rstrip("/") + "/"):
        skip(
            path,
            f"is a symlink to {real}, outside the root; ckptd does not follow it",
            "serve that directory's own root, or move the job under this one",
        )
