"""Resume: load the newest checkpoint that is whole, or say clearly that there is none.

The work of choosing is the load's (ckpt._load.load_from_tiers with fallback): the
newest committed step is tried first, in every tier that holds it; a step that fails
verification on any rank (CorruptCheckpoint: a hash mismatch, a missing or truncated
shard, a bad index) is quarantined and the previous one is tried, every rank agreeing on
the step (with require_finite, a step whose saved stats count NaN or Inf is passed over
the same way, not quarantined). What resume adds is the policy around it:

- every step it passes over (newer than the one it loads) is logged with the reason: a
  step directory without a manifest (a save that never committed: aborted, or a rank
  killed mid-write), a manifest that does not parse, a step quarantined earlier. Older
  ones are not: resume never came to them, and one may be a step that retention is
  removing this moment (its manifest goes first);
- None only when the job has no checkpoint at all: nothing ever committed (no step
  directory, or only saves that never committed);
- when checkpoints were committed but none loads, an error, never a silent fresh start
  (promise 2), unless the caller asks for one with allow_fresh_start=True.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ckpt._load import Tier, tier_steps
from ckpt._restore import LoadResult
from ckptd.errors import CheckpointNotFound, CorruptCheckpoint, NonFiniteCheckpoint
from ckptd.format import checkpoint as ckfmt

log = logging.getLogger("ckpt")


def resume(
    path: str,
    tiers: Sequence[Tier],
    load: Callable[..., LoadResult],
    state: Any,
    *,
    rank: int,
    allow_fresh_start: bool,
    strict: bool,
    require_finite: bool = False,
) -> int | None:
    """Resume job `path` from `tiers` with `load` (the Checkpointer's: the load policy)."""
    # A step counts when any tier holds it (a wiped local disk resumes from the mirror,
    # not from scratch); a job without a mirror is one tier.
    steps = tier_steps(tiers)
    lead = rank == 0  # one rank tells what storage holds; every rank tells its own failures
    skipped = [s for s in reversed(steps) if s.status != ckfmt.COMMITTED]
    # A step directory without a manifest never was a checkpoint; any other status means
    # one was committed (and may have been damaged or marked bad since).
    if all(s.status == ckfmt.INCOMPLETE for s in steps):
        _log_skipped(path, skipped, lead)
        if lead and steps:
            log.warning(
                "resume %s: nothing was ever committed (%d unfinished save(s)); starting fresh",
                path,
                len(steps),
            )
        elif lead:
            log.info("resume %s: no checkpoint yet; starting fresh", path)
        return None
    try:
        res = load(state, strict=strict, require_finite=require_finite)
    except (CorruptCheckpoint, CheckpointNotFound, NonFiniteCheckpoint) as e:
        reasons = [f"step {s.step}: {s.status.lower()}: {s.error}" for s in skipped]
        message = (
            f"resume {path}: checkpoints were committed but none can be loaded whole "
            f"({'; '.join([*reasons, str(e)])}). Nothing usable was loaded (tensors in the "
            "state may hold verified bytes of a failed step). Check the storage (`ckptctl "
            "verify --all`), restore a copy, or pass allow_fresh_start=True to start from "
            "scratch on purpose"
        )
        if allow_fresh_start:
            log.error("%s; starting fresh as allowed", message)
            return None
        raise CheckpointNotFound(message) from e
    _log_skipped(path, [s for s in skipped if s.step > res.step], lead)
    if lead and res.unhealthy:
        # Loud: training goes on from an older step than the newest it saved.
        log.warning(
            "resume %s: resumed from step %d, the newest step with finite values: passed over "
            "step(s) %s whose saved stats count NaN or Inf values (require_finite): %s",
            path,
            res.step,
            ", ".join(map(str, res.unhealthy)),
            res.fallback_reason,
        )
    elif lead:
        log.info(
            "resume %s: resumed from step %d%s",
            path,
            res.step,
            (
                f" (step {res.fell_back_from} failed verification and is now quarantined)"
                if res.quarantined
                else f" (step {res.fell_back_from} could not be read: {res.fallback_reason}; "
                "not quarantined, the error may be transient)"
            )
            if res.fell_back_from is not None
            else "",
        )
    return res.step


def _log_skipped(path: str, skipped: Sequence[ckfmt.StepInfo], lead: bool) -> None:
    if not lead:
        return
    for s in skipped:
        log.warning(
            "resume %s: skipping step %d: %s: %s",
            path,
            s.step,
            s.status.lower(),
            s.error or "no reason recorded",
        )
