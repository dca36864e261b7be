"""Named crash points for fault-injection tests.

`crash_point("rank.mid_write")` SIGKILLs the process when CKPT_CRASH_AT names that point
(optionally `name@rank` to pick one rank, via $RANK). With the variable unset it costs
one dict lookup. Points in use:

    rank.after_stage  rank.mid_write  rank.before_report  rank.after_report
    coordinator.after_barrier  coordinator.mid_manifest  coordinator.after_manifest_rename
    coordinator.after_catalog_commit  coordinator.during_retention
    coordinator.retention_unpublished  coordinator.retention_mid_recycle (inside a retirement)
    coordinator.node_batch_unanswered  coordinator.mid_node_reports (node batches only)
"""

from __future__ import annotations

import os
import signal

_ENV = "CKPT_CRASH_AT"


def crash_point(name: str) -> None:
    target = os.environ.get(_ENV)
    if not target:
        return
    point, _, rank = target.partition("@")
    if point != name:
        return
    if rank and rank != os.environ.get("RANK", "0"):
        return
    os.kill(os.getpid(), signal.SIGKILL)
