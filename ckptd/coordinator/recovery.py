"""Recovery: what a coordinator does when it starts, before it answers anyone.

A previous life may have left saves open (finished when every shard was durably reported,
aborted otherwise), a retention run half done (finished for exactly the steps listed in
`retiring`), or no catalog at all (rebuilt from the manifests under the root, promise 6).
The Coordinator inherits these as `recover()` and `rebuild_from_storage()`; they need of it
only its root, its catalog and a job's storage, declared below.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable

from ckptd.coordinator import retention, session
from ckptd.coordinator.catalog import Catalog, SaveRecord
from ckptd.coordinator.types import ABORTED, COMMITTED, COMMITTING, OPEN, QUARANTINED
from ckptd.errors import CkptError
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, layout
from ckptd.storage import JobLocation, Storage

log = logging.getLogger("ckptd.coordinator")


class Recovery:
    """Start-up recovery and catalog rebuild, mixed into the Coordinator."""

    root: str
    location: JobLocation
    catalog: Catalog
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
            if rec.status not in (OPEN, COMMITTING):
                continue
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
                self.catalog.found_save(
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
                found += 1
            n += found
            newest = self.catalog.generation(job)
            if found and (newest is None or newest < gen):
                self.catalog.found_generation(job, gen)
                self._generations[job] = gen
        return n


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
