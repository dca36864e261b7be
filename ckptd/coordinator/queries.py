"""The catalog's answers about a job's checkpoints, and the two records loaders add.

What `ckptctl list --coordinator` and a loader ask the coordinator: the job's saves, one
step (by default the head of the live line, as a load without a step would pick it), and
the two facts a client reports after a commit: a step found corrupt (quarantine) and what
a mirror holds. Mixed into the Coordinator; it needs of it the catalog, the observer, job
names and storage, declared below.
"""

from __future__ import annotations

import asyncio
import logging

from ckptd.coordinator import observer as obs
from ckptd.coordinator.catalog import Catalog, SaveRecord
from ckptd.coordinator.types import COMMITTED, QUARANTINED, TIER_REMOVED, TIER_STATUSES
from ckptd.errors import CheckpointNotFound, InvalidRequest
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.storage import Storage

log = logging.getLogger("ckptd.coordinator")


class Queries:
    """The catalog queries and client-reported records of the Coordinator."""

    catalog: Catalog
    observer: obs.SaveObserver

    def job_name(self, job: str) -> str:
        raise NotImplementedError

    def storage(self, job: str) -> Storage:
        raise NotImplementedError

    def list_checkpoints(self, job: str) -> list[SaveRecord]:
        return self.catalog.saves(self.job_name(job))

    def get_checkpoint(self, job: str, step: int | None) -> SaveRecord:
        name = self.job_name(job)
        if step is not None:
            _check_step(name, step)
        if step is None:
            head = self._head(name)
            if head is None:
                raise CheckpointNotFound(f"job {name!r} has no committed checkpoint")
            return head
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
        await asyncio.to_thread(ckfmt.quarantine, st, step, reason)
        if rec.status != QUARANTINED:
            log.warning("job %s step %d quarantined: %s", name, step, reason)
            self.observer.verification_failed(name, step, "load", reason)
            await self.catalog.mark_quarantined(name, step, reason)
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
        if status != TIER_REMOVED and status not in TIER_STATUSES:
            raise InvalidRequest(f"job {name!r} step {step}: unknown tier status {status!r}")
        await self.catalog.record_tier(name, step, tier, url, status, reason)

    def _head(self, name: str) -> SaveRecord | None:
        """The head of the job's live line among the catalog's committed saves (the rule is
        ckfmt.live_line's: the save committed last, back through parents)."""
        recs = {r.step: r for r in self.catalog.saves(name) if r.status in (COMMITTED, QUARANTINED)}
        line = ckfmt.live_line(
            ckfmt.LineStep(r.step, r.parent, r.committed_unix) for r in recs.values()
        )
        return next((recs[k] for k in line if recs[k].status == COMMITTED), None)


def _check_step(job: str, step: int) -> None:
    try:
        layout.check_step(step)
    except ValueError as e:
        raise InvalidRequest(f"job {job!r}: {e}") from None
