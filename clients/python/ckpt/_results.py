"""What a save hands back, and the checks every save applies to its inputs.

Shared by the module-level functions, the Checkpointer, the pending handle and the
integrations, so it imports nothing of the client: every other module may import it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from ckptd.errors import UnsupportedValue

log = logging.getLogger("ckpt")


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """What a committed save cost. The phases are this rank's (the coordinator exports the
    same timings of every rank as Prometheus metrics): staging (blocking) -> persist
    (background: hashing, planning, write_s, verify_s) -> commit (report to COMMITTED)."""

    step: int
    path: str  # the step directory
    bytes: int  # bytes this rank wrote into its shard
    seconds: float  # wall time of the whole save
    write_s: float = 0.0  # writing + hashing + fsync
    verify_s: float = 0.0  # re-reading and checking
    tensors: int = 0
    staging_s: float = 0.0  # copy into host memory (0 when the save wrote from the tensors)
    # Of staging_s: the wait for the staging buffer, still being mapped in the background
    # (Checkpointer.resume starts it) when the first save came; 0 once it is ready.
    image_wait_s: float = 0.0
    # Of blocking_s: Python's garbage collector (a full collection, due after enough
    # allocations in any thread, runs in whatever allocates then; ckpt._gcclock).
    gc_s: float = 0.0
    persist_s: float = 0.0  # the background part up to the report (includes write_s, verify_s)
    commit_s: float = 0.0  # from this rank's report to COMMITTED
    blocking_s: float = 0.0  # what the training loop waited for
    borrowed_bytes: int = 0  # bytes an incremental save did not write: an earlier step's

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def log_saved(result: SaveResult, where: str) -> None:
    """One INFO line per committed save (logger "ckpt"), so the timings land in job logs."""
    # A first save that came before its staging buffer was mapped says what it waited for.
    waited = (
        f" ({result.image_wait_s:.3f} s of it waiting for the staging buffer to be mapped)"
        if result.image_wait_s >= 0.0005
        else ""
    )
    # And one whose stall held a garbage collection, how much of it that was.
    collected = (
        f" ({result.gc_s:.3f} s of it in Python's garbage collector)"
        if result.gc_s >= 0.0005
        else ""
    )
    log.info(
        "%s: committed %.3f GB in %.2f s (%.2f GB/s): blocking %.3f s%s, staging %.3f s%s, "
        "persist %.2f s (write %.2f s, verify %.2f s), commit %.2f s",
        where,
        result.bytes / 1e9,
        result.seconds,
        result.gbps,
        result.blocking_s,
        collected,
        result.staging_s,
        waited,
        result.persist_s,
        result.write_s,
        result.verify_s,
        result.commit_s,
    )


def check_metadata(metadata: Any) -> dict[str, Any]:
    """The user's metadata as a dict of plain JSON values, or UnsupportedValue."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise UnsupportedValue(
            f"metadata must be a dict of JSON values, got {type(metadata).__name__}"
        )
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnsupportedValue(
            f"metadata is not plain JSON ({e}); put tensors and other values in the state instead"
        ) from None
    return metadata
