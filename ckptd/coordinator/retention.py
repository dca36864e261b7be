"""Retention: which steps of a job to remove, decided once (docs/concepts.md, Retention).

`plan` is the rule, a pure function from what is known of a job's steps to a frozen
`RetentionPlan`. Every place that removes old steps asks it: the coordinator (after each
commit with keep_last; it lists each retired step in the catalog's `retiring` table before
removing it, so a restart finishes the removal), `ckpt.apply_retention` and the mirror
(`apply`, from storage alone). The callers differ only in how they learn the steps' states
(`from_catalog`, `from_storage`) and in what they record (`carry_out` records in the
catalog, `apply` nothing); never in what is removed.

The promise: only steps of the job's live line (`ckfmt.live_line`: the save made last,
back through each step's parent) are retired, never the newest `keep_last` of it, never
the save the plan runs for (`keep`), never a step off the line (an abandoned branch after a
rollback: kept and listed, `ckptctl list`, until the user removes it), never a save in
flight, never a manifest that cannot be read (it may be whole), and never a step that a
step staying borrows bytes from (an incremental save's `borrows`, ShardInfo), nor the
step a save in flight descends from (its base: what it may borrow): `keep_borrowed`, the
one rule for what shared bytes hold, which `ckptctl gc`'s own removals obey too. A step
is removed whole or not at all, so removing one frees only bytes nothing kept uses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable, Mapping

from ckptd import knobs
from ckptd.coordinator.catalog import Catalog, SaveRecord
from ckptd.coordinator.types import COMMITTED as SAVE_COMMITTED
from ckptd.coordinator.types import COMMITTING as SAVE_COMMITTING
from ckptd.coordinator.types import OPEN as SAVE_OPEN
from ckptd.coordinator.types import QUARANTINED as SAVE_QUARANTINED
from ckptd.errors import CheckpointExists, CkptError
from ckptd.faults import crash_point
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout, recycle
from ckptd.storage.base import Storage

log = logging.getLogger("ckptd.coordinator")

# What retention knows of a step.
COMMITTED = "COMMITTED"  # whole; counts towards keep_last
QUARANTINED = "QUARANTINED"  # committed, failed verification on load; never loaded again
UNFINISHED = "UNFINISHED"  # a step directory without a manifest, no save in flight: debris
IN_FLIGHT = "IN_FLIGHT"  # a save still open (planning, writing, committing): untouchable
UNREADABLE = "UNREADABLE"  # a manifest that does not parse (newer format, too large): kept


@dataclasses.dataclass(frozen=True)
class StepState:
    step: int
    status: str
    saved_unix: float = 0.0  # when it was saved (0: unknown); the order of a live line
    parent: int | None = None  # the step it descends from (None: not recorded)
    # The steps whose files it reads bytes from (an incremental save's); None: not known
    # (a manifest that cannot be read), taken as every lower step (a save's base is the
    # step it descends from, normally a lower one).
    borrows: tuple[int, ...] | None = ()


@dataclasses.dataclass(frozen=True)
class RetentionPlan:
    """What to remove: `retire` (committed or quarantined: un-publish, then remove, the
    shard files recycled) and `debris` (step directories no save will finish)."""

    retire: tuple[int, ...] = ()
    debris: tuple[int, ...] = ()
    # Steps the rule would retire that stay because a step that stays borrows from them.
    held: tuple[int, ...] = ()

    @property
    def steps(self) -> tuple[int, ...]:
        """Every step the plan removes, oldest first (the order to remove them in)."""
        return tuple(sorted(self.retire + self.debris))


def live_line(steps: Iterable[StepState]) -> list[int]:
    """The job's live line, head first (`ckfmt.live_line`) over the committed and
    quarantined steps; an unfinished or unreadable step is a gap in it, not its end."""
    steps = list(steps)
    return ckfmt.live_line(
        (s for s in steps if s.status in (COMMITTED, QUARANTINED)),
        gaps={s.step for s in steps if s.status in (UNFINISHED, UNREADABLE)},
    )


def plan(steps: Iterable[StepState], keep_last: int, keep: Collection[int] = ()) -> RetentionPlan:
    """The rule: keep the newest `keep_last` committed steps of the live line, remove the
    line behind them.

    - the live line is `live_line`: `ckfmt.live_line` over the committed and quarantined
      steps;
    - committed steps of the line behind its newest `keep_last` committed ones are retired;
    - a quarantined step of the line is retired once `keep_last` committed steps of the
      line are ahead of it;
    - unfinished step directories below the line's newest committed step are debris;
    - nothing off the line (an abandoned branch), nothing in `keep` (the save a commit's
      retention runs for: a save reported committed is never removed by its own commit),
      nothing in flight, nothing unreadable, and nothing at all while no step is committed.
    """
    if keep_last < 1:
        raise ValueError(
            f"keep_last must be at least 1 (the newest checkpoint is always kept), got {keep_last}"
        )
    steps = list(steps)
    status = {s.step: s.status for s in steps}
    line = live_line(steps)
    committed = [k for k in line if status[k] == COMMITTED]  # head first
    if not committed:
        return RetentionPlan()
    retire = committed[keep_last:]
    if len(committed) >= keep_last:
        behind = line[line.index(committed[keep_last - 1]) + 1 :]
        retire += [q for q in behind if status[q] == QUARANTINED]
    newest = max(committed[:keep_last])
    debris = [s.step for s in steps if s.status == UNFINISHED and s.step < newest]
    retire = [k for k in retire if k not in keep]
    debris = [k for k in debris if k not in keep]
    held = keep_borrowed(steps, retire)
    retire = [k for k in retire if k not in held]
    return RetentionPlan(tuple(sorted(retire)), tuple(sorted(debris)), tuple(sorted(held)))


def keep_borrowed(steps: Iterable[StepState], removing: Collection[int]) -> set[int]:
    """The steps of `removing` that must stay: those a step that stays borrows bytes from,
    and, through them, what they borrow; a save in flight counts as staying and as
    borrowing from the step it descends from (its base, known before its index is)."""
    by_step = {s.step: s for s in steps}
    gone = set(removing)
    todo = [s for s in by_step.values() if s.step not in gone]
    held: set[int] = set()
    while todo:
        s = todo.pop()
        unknown = s.borrows is None or s.status == UNREADABLE
        lent = {k for k in gone if k < s.step} if unknown else set(s.borrows or ())
        if s.status == IN_FLIGHT and s.parent is not None:
            lent.add(s.parent)
        for k in lent:
            if k in gone and k not in held:
                held.add(k)
                if k in by_step:
                    todo.append(by_step[k])
    return held


def make_way(storage: Storage, step: int, *, where: str, spare: Collection[str] = ()) -> str | None:
    """Before a new save of `step` in `storage`: what stands there gives way, or the save
    is refused. Every place a save begins asks here (the coordinator, the plug-ins that
    write alone, a mirror's upload).

    - No checkpoint there (no manifest): None; nothing is done.
    - A committed checkpoint: CheckpointExists. A committed step is never replaced.
    - A quarantined one gives way. It failed verification, so resume fell back past it, and
      training that goes on reaches the same step again: refusing that save would stop
      the job at every restart. Its manifest goes first (a crash leaves debris, never a
      half checkpoint), then the files it names (not those in `spare`, which the new save
      writes under the same names), then its marker, with a warning. Returns why it was
      quarantined.
    - A quarantined one that a step that stays borrows bytes from (`keep_borrowed`):
      CheckpointExists, naming the way out.
    """
    sdir = layout.step_dir(step)
    if not storage.exists(f"{sdir}/{layout.MANIFEST_NAME}"):
        return None
    reason = ckfmt.quarantine_reason(storage, step)
    if reason is None:
        raise CheckpointExists(
            f"{where}: {storage.url}/{sdir} is already committed; save under a new step, "
            "or remove it first (ckptctl gc)"
        )
    if keep_borrowed(from_storage(storage), (step,)):
        raise CheckpointExists(
            f"{where}: {storage.url}/{sdir} is quarantined ({reason[:200]}), but a step that "
            "stays borrows bytes from it (an incremental save), so it cannot give way to a "
            "new save; save under a new step, or remove the steps that borrow from it first"
        )
    try:
        files = [p for sh in ckfmt.read_manifest(storage, step).shards for p in (sh.path, sh.index)]
    except CkptError:
        files = []  # a manifest that does not parse: its files stay, strays for `ckptctl gc`
    storage.remove_tree(f"{sdir}/{layout.MANIFEST_NAME}")
    for path in files:
        if path not in spare:
            storage.remove_tree(f"{sdir}/{path}")
    storage.remove_tree(f"{sdir}/{ckfmt.QUARANTINE_NAME}")
    log.warning(
        "%s: a new save takes the place of the quarantined checkpoint %s/%s, whose files are "
        "removed (it was quarantined: %s)",
        where,
        storage.url,
        sdir,
        reason,
    )
    return reason


# -- what the callers know ---------------------------------------------------------------
def from_storage(storage: Storage, in_flight: Collection[int] = ()) -> list[StepState]:
    """The steps of a job directory as storage alone tells them (no catalog)."""
    out = []
    for info in ckfmt.list_steps(storage, manifests=False):
        line = info.line
        saved, parent = (line.saved_unix, line.parent) if line is not None else (0.0, None)
        if info.step in in_flight:
            status = IN_FLIGHT
        elif info.status == ckfmt.COMMITTED:
            status = COMMITTED
        elif info.status == ckfmt.QUARANTINED:
            status = QUARANTINED
        elif info.status == ckfmt.INCOMPLETE:
            status = UNFINISHED
        else:  # INVALID: a manifest this reader cannot parse may still be whole
            status = UNREADABLE
        borrows = line.borrows if line is not None else ()
        out.append(StepState(info.step, status, saved, parent, borrows))
    return out


def with_borrows(
    storage: Storage, steps: Iterable[StepState], known: dict[tuple[int, float], tuple[int, ...]]
) -> list[StepState]:
    """`steps` with what each committed or quarantined one borrows, from its manifest
    (blocking; ckfmt.read_lineage, which parses a manifest's bytes once a process).
    `known`: the caller's memory of them by (step, saved_unix); a committed manifest never
    changes, so each is read once. One that cannot be read borrows nothing known (it is
    not retired either: from_catalog's statuses)."""
    out = []
    for s in steps:
        if s.status in (COMMITTED, QUARANTINED):
            got = known.get((s.step, s.saved_unix))
            if got is None:
                try:
                    got = ckfmt.read_lineage(storage, s.step).borrows
                except (CkptError, OSError):
                    got = None
                if got is None:
                    out.append(dataclasses.replace(s, borrows=None))  # unknown: holds more
                    continue
                remember_borrows(known, s.step, s.saved_unix, got)
            s = dataclasses.replace(s, borrows=got)
        out.append(s)
    return out


def remember_borrows(
    known: dict[tuple[int, float], tuple[int, ...]],
    step: int,
    saved_unix: float,
    borrows: Iterable[int],
) -> None:
    """Record in `known` (with_borrows' memo) what a committed step borrows, keyed as
    with_borrows looks it up; the memo is emptied past 4096 steps, to be read again."""
    if len(known) > 4096:
        known.clear()
    known[(step, saved_unix)] = tuple(borrows)


def from_catalog(
    records: Iterable[SaveRecord], dirs: Mapping[int, bool], in_flight: Collection[int]
) -> list[StepState]:
    """The steps of a job as the coordinator knows them: its catalog's records, the step
    directories in storage (step -> holds a manifest) and the saves it holds open.

    The catalog decides for the steps it calls committed, quarantined or open; a directory
    it has no such word for is debris without a manifest, and kept with one (a manifest
    the catalog does not know is not the coordinator's to judge)."""
    out: dict[int, StepState] = {}
    for rec in records:
        if rec.status == SAVE_COMMITTED:
            out[rec.step] = StepState(rec.step, COMMITTED, rec.committed_unix, rec.parent)
        elif rec.status == SAVE_QUARANTINED:
            out[rec.step] = StepState(rec.step, QUARANTINED, rec.committed_unix, rec.parent)
        elif rec.status in (SAVE_OPEN, SAVE_COMMITTING):
            out[rec.step] = StepState(rec.step, IN_FLIGHT, rec.created_unix, rec.parent)
    for step in in_flight:
        if step not in out or out[step].status != IN_FLIGHT:
            out[step] = StepState(step, IN_FLIGHT)
    for step, has_manifest in dirs.items():
        if step not in out:
            out[step] = StepState(step, UNREADABLE if has_manifest else UNFINISHED)
    return sorted(out.values(), key=lambda s: s.step)


def step_dirs(storage: Storage) -> dict[int, bool]:
    """Each step directory of a job -> whether it holds a manifest (no manifest is read)."""
    out = {}
    for name in storage.listdir(""):
        step = layout.parse_step_dir(name)
        if step is not None:
            out[step] = storage.exists(f"{name}/{layout.MANIFEST_NAME}")
    return out


# -- carrying a plan out -----------------------------------------------------------------
def retire(storage: Storage, step: int) -> None:
    """Remove a committed (or quarantined) step: manifest first, its shard files recycled."""
    recycle.retire_step(storage, step, keep_files=knobs.get().recycle_files)


def remove_debris(storage: Storage, step: int) -> None:
    """Remove a step directory that holds no checkpoint."""
    ckfmt.remove_step(storage, step)


async def carry_out(
    catalog: Catalog,
    st: Storage,
    job: str,
    p: RetentionPlan,
    began: Callable[[int], bool],
    lock: asyncio.Lock,
) -> None:
    """The coordinator's way to carry out a plan: each retired step is listed in the
    catalog's `retiring` table before anything of it is removed, and its rows go after, so
    a restart finishes exactly these steps (recovery). `began(step)`: a save of that step
    opened since the plan was made (it is skipped). `lock`: held while a step is removed,
    as while a save opens (so none opens on a step half removed)."""
    for step in p.steps:
        async with lock:
            if began(step):
                continue
            retiring = step in p.retire
            if retiring:
                await catalog.add_retiring(job, step)
            try:
                await asyncio.to_thread(retire if retiring else remove_debris, st, step)
            except (OSError, CkptError) as e:
                log.warning("retention: could not remove job %s step %d: %s", job, step, e)
                continue
            if retiring:
                # The widest window: the step is gone from storage, still in the catalog.
                crash_point("coordinator.during_retention")
                await catalog.forget_retired(job, step)


def apply(storage: Storage, keep_last: int, in_flight: Collection[int] = ()) -> list[int]:
    """Carry out the plan for a job directory from storage alone; the steps removed.

    For callers without a coordinator's catalog (`ckpt.apply_retention`, a mirror). It
    cannot see saves in flight: pass their steps, or run it where none can be."""
    p = plan(from_storage(storage, in_flight), keep_last)
    for step in p.steps:
        if step in p.retire:
            retire(storage, step)
        else:
            remove_debris(storage, step)
    return list(p.steps)
