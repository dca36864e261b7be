"""Loading from tiers: the nearest copy that verifies, else the next tier, else an older step.

A job with a mirror has up to two copies of each step: the job's directory (local, fast)
and the mirror. A load tries steps newest first (the newest committed in any tier); for
each step, the tiers that hold it nearest first. A copy that fails verification
(CorruptCheckpoint: hash mismatch, missing or truncated shard, bad index) is quarantined
in its tier (and on_quarantine is told, for the local tier's catalog row) and the next
copy is tried, so a damaged local disk never sends a restarted job into a loop, and never
costs a step the mirror still has. An I/O error that is not damage (the device refused a
read, the mirror is unreachable) skips that copy without quarantining it.

Under torch.distributed every rank must call it: the ranks agree on each attempt (one
all_reduce per copy tried), as in ckpt._restore.load_checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ckpt._restore import LoadResult, _reduce_max, load_checkpoint
from ckptd.errors import CheckpointNotFound, CkptError, CorruptCheckpoint
from ckptd.format import checkpoint as ckfmt
from ckptd.storage.base import Storage

log = logging.getLogger("ckpt")

Tier = tuple[str, Storage]  # (name, storage), nearest first
_OK, _CORRUPT, _UNREADABLE, _FAILED = 0, 1, 2, 3


def tier_steps(tiers: Sequence[Tier]) -> list[ckfmt.StepInfo]:
    """Each step's best status over the tiers (COMMITTED when any tier holds it whole)."""
    best: dict[int, ckfmt.StepInfo] = {}
    rank = {ckfmt.COMMITTED: 0, ckfmt.QUARANTINED: 1, ckfmt.INVALID: 2, ckfmt.INCOMPLETE: 3}
    for name, st in tiers:
        for s in _listed(name, st, ckfmt.list_steps, []):
            old = best.get(s.step)
            if old is None or rank.get(s.status, 9) < rank.get(old.status, 9):
                best[s.step] = s
    return [best[k] for k in sorted(best)]


def holders(tiers: Sequence[Tier]) -> dict[int, list[str]]:
    """For each step, the names of the tiers whose copy is committed (not quarantined)."""
    out: dict[int, list[str]] = {}
    for name, st in tiers:
        for step in _listed(name, st, ckfmt.committed_steps, []):
            out.setdefault(step, []).append(name)
    return {k: out[k] for k in sorted(out)}


def _listed(name: str, st: Storage, fn: Callable[[Storage], Any], empty: Any) -> Any:
    """A tier's listing; an unreachable tier (the mirror down) counts as holding nothing."""
    try:
        return fn(st)
    except Exception as e:  # noqa: BLE001 - any store client error: that tier is out
        log.error(
            "the %s tier %s cannot be listed (%s: %s); loading from the other tiers",
            name,
            st.url,
            type(e).__name__,
            e,
        )
        return empty


def load_tiered(
    tiers: Sequence[Tier],
    state: Any,
    *,
    step: int | None = None,
    strict: bool = True,
    keys: str | list[str] | None = None,
    cast: bool = False,
    rank: int = 0,
    fallback: bool = True,
    on_quarantine: Callable[[str, int, str], None] | None = None,
    catalog_blake3: Callable[[int], str | None] | None = None,
) -> LoadResult:
    # catalog_blake3: as in load_checkpoint; a mirror's manifest is the same bytes as the
    # local one, so the catalog's commit record checks every tier's copy.
    held = holders(tiers)
    # The ranks agree on every step and every copy they try (a rank may already see a
    # quarantine marker another rank wrote; a load by explicit step ignores markers, so
    # trying a copy that any rank still sees as committed is safe on all of them).
    current = step if step is not None else _reduce_max(max(held, default=-1))
    if current < 0:
        ckfmt.resolve_step(tiers[0][1], None)  # raises CheckpointNotFound with the details
    failures: list[str] = []
    first_error: CkptError | None = None
    while current >= 0:
        at = current
        for name, st in tiers:
            # An explicit step: every tier is asked, so each says why not.
            present = step is not None or name in held.get(at, [])
            if not _reduce_max(int(present)):
                continue
            error: BaseException | None = None
            try:
                res = load_checkpoint(
                    st,
                    state,
                    step=at,
                    strict=strict,
                    keys=keys,
                    cast=cast,
                    rank=rank,
                    catalog_blake3=catalog_blake3,
                )
            except CorruptCheckpoint as e:
                error = e
                code = _UNREADABLE if isinstance(e.__cause__, OSError) else _CORRUPT
            except (CheckpointNotFound, OSError) as e:
                error, code = e, _UNREADABLE
            except BaseException as e:  # noqa: BLE001 - re-raised once the ranks agree
                error, code = e, _FAILED
            else:
                code = _OK
            agreed = _reduce_max(code)
            if agreed == _OK:
                if failures:
                    log.warning(
                        "loaded step %d from the %s tier (%s) after: %s",
                        at,
                        name,
                        st.url,
                        "; ".join(failures),
                    )
                    res = dataclasses.replace(res, fallback_reason="; ".join(failures))
                return res
            if agreed == _FAILED:
                if error is not None and code == _FAILED:
                    raise error
                raise CkptError(
                    f"{st.url} step {at}: another rank failed to load it (see its log); "
                    "this rank's load is abandoned so that all ranks stay at the same step"
                ) from error
            if first_error is None and isinstance(error, CkptError):
                first_error = error
            reason = f"rank {rank}: {error}" if error is not None else "another rank failed"
            if code == _CORRUPT:
                _quarantine(name, st, at, reason, on_quarantine)
            failures.append(f"step {at} in the {name} tier ({st.url}): {reason}")
            log.error(
                "CHECKPOINT STEP %d IN THE %s TIER (%s) %s: %s; trying the next copy",
                at,
                name.upper(),
                st.url,
                "FAILED VERIFICATION AND IS QUARANTINED"
                if code == _CORRUPT
                else "COULD NOT BE READ",
                reason,
            )
        if step is not None or not fallback:  # fallback=False: the newest step's copies only
            break
        current = _reduce_max(max((s for s in held if s < at), default=-1))
    kind = type(first_error) if first_error is not None else CheckpointNotFound
    raise kind(
        f"no copy of {'step ' + str(step) if step is not None else 'any committed step'} "
        f"could be loaded from the tiers {', '.join(f'{n} ({s.url})' for n, s in tiers)}: "
        f"{'; '.join(failures) or 'none holds it'}. Nothing valid was loaded; check the "
        "stores with `ckptctl verify --all`"
    ) from first_error


def _quarantine(
    name: str,
    st: Storage,
    step: int,
    reason: str,
    on_quarantine: Callable[[str, int, str], None] | None,
) -> None:
    try:
        if ckfmt.quarantine_reason(st, step) is None:
            ckfmt.quarantine(st, step, reason)
        if on_quarantine is not None:
            on_quarantine(name, step, reason)
    except (CkptError, OSError) as e:
        log.error("could not quarantine %s step %d: %s", st.url, step, e)
