"""SaveObserver: what the coordinator core tells whoever watches it (metrics, tests).

The core calls these at a few points of a save's life; the default does nothing, so the
core needs no metrics library and a server without metrics pays nothing. Calls come from
the core's event loop and must not block (a Prometheus counter increment is fine).
"""

from __future__ import annotations

from ckptd.coordinator.types import ShardReport

# How a save ended, as observers see it: aborted by a rank, a lease, a barrier timeout or a
# newer generation; failed when the coordinator's own checks or the commit itself failed.
COMMITTED, ABORTED, FAILED = "committed", "aborted", "failed"


class SaveObserver:
    """No-op base; override what you need."""

    def shard_reported(self, job: str, step: int, rank: int, report: ShardReport) -> None:
        """A rank's shard passed the coordinator's checks (the report carries its timings)."""

    def verification_failed(self, job: str, step: int, where: str, reason: str) -> None:
        """A shard failed a check: where="report" (the coordinator's check of a reported
        shard) or "load" (a load found a committed step corrupt and quarantined it)."""

    def save_ended(
        self, job: str, step: int, outcome: str, *, bytes: int = 0, commit_s: float = 0.0
    ) -> None:
        """A save ended: outcome is COMMITTED, ABORTED or FAILED; for a commit, its bytes and
        the seconds from the last shard's report to the durable commit."""
