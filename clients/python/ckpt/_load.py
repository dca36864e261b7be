"""The load policy: which step, which copy, what a failure means. One function for every load.

A job has one tier (its directory) or several, nearest first (this node's memory and a
peer node's with a memory tier, ckpt._memory; the directory; a mirror); a load is `load_from_tiers(tiers, state, ...)` either way. Restoring one step
from one storage is ckpt._restore's; this module decides around it:

- Which step. An explicit `step` is that step, whatever markers say. Otherwise the head of
  the job's live line (`ckfmt.live_line`: the step saved last, back through each step's
  parent; after a rollback the abandoned branch is on no line) that is committed
  (manifest present, not quarantined) in some tier, in the view of every rank (see
  _agreed_newest for why every rank's view, not any rank's).
- Which copies. For that step, each tier's copy nearest first: with an explicit step every
  tier is asked (each says why not); otherwise the copies this rank sees committed. A
  rank stops at its first copy that loads; ranks need not agree on the tier, since every
  copy of a step is the same bytes and every byte is verified.
- Who reads. Under a process group a load that chooses its step (or read="shared") reads
  together: the ranks try each tier's copy in step, and a copy every rank planned is read
  once for the job and sent to the ranks that need it (ckpt._shared_read); otherwise, or
  with read="each", every rank reads what it needs itself.
- What a failure is. Damage (CorruptCheckpoint: a hash mismatch, a missing or truncated
  shard, a bad index or manifest) and unreadable (an OSError: the device refused a read,
  the tier is unreachable, the step is not in that tier) send the rank to the next copy;
  anything else (StateMismatch: the target does not match) fails the load at once.
- Fallback. Only a load that chooses its step (no explicit step, fallback=True) moves on
  to older steps of the live line, never to an abandoned branch: when any rank could load no copy of the step, every rank moves to the
  next older one together (one all_reduce per decision, ckpt._agree), and only such a
  load quarantines: a damaged copy gets QUARANTINED.json in its tier (kept if a peer wrote
  it first) and on_quarantine(tier, step, reason) is called; an unreadable copy is skipped
  unmarked (the error may be transient). A load by explicit step, or with fallback=False,
  tries that one step's copies, marks nothing, uses no collective unless read="shared"
  (any subset of ranks may call it), and raises when none loads.
- Health (require_finite). A step whose shard indexes count NaN or Inf values in a tensor
  the load asks for (ckptd.format.health, from the stats recorded as the bytes were
  hashed: no tensor byte is read to judge it) is refused before it is planned, loudly
  (job, step, keys and counts), and not quarantined: it is whole, and a load by explicit
  step without require_finite still reads it. A load that chooses its step moves to the
  next older one like after damage (every rank judges the same indexes, so they agree);
  an explicit step raises NonFiniteCheckpoint. A step without stats (saved before they
  were recorded) is loaded, with a warning that its health is unknown: refusing it would
  refuse every checkpoint a job wrote before the upgrade.
- The final error has the type of this rank's first failure and lists every step and copy
  tried, with what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ckpt import _provenance
from ckpt import _shared_read as _shared
from ckpt._agree import agree_max, agree_min
from ckpt._restore import LoadResult, PreparedStep, Reads, keys_patterns, matching, prepare_step
from ckptd.errors import (
    CheckpointNotFound,
    CkptError,
    CorruptCheckpoint,
    NonFiniteCheckpoint,
    PeerReadFailed,
)
from ckptd.format import checkpoint as ckfmt
from ckptd.format import health, layout
from ckptd.format.boxes import BoxPlan, read_planned
from ckptd.format.checkpoint import OpenCheckpoint
from ckptd.storage.base import Storage

log = logging.getLogger("ckpt")

Tier = tuple[str, Storage]  # (name, storage), nearest first

READ_MODES = ("auto", "shared", "each")

# A rank's outcome for one step, agreed as the largest over the ranks.
_OK, _NEXT, _FAILED = 0, 1, 2


def _listings(tiers: Sequence[Tier]) -> list[list[ckfmt.StepInfo]]:
    """Each tier's steps. A tier that cannot be listed (the mirror down) counts as holding
    nothing while another tier holds a committed step; when none does, its error is raised,
    so an unreachable store never reads as "no checkpoint yet" (a silent fresh start)."""
    out: list[list[ckfmt.StepInfo]] = []
    errors: list[tuple[str, Storage, Exception]] = []
    for name, st in tiers:
        try:
            out.append(ckfmt.list_steps(st, manifests=False))
        except Exception as e:  # noqa: BLE001 - any store client error: that tier is out
            errors.append((name, st, e))
            out.append([])
    if errors and not any(s.status == ckfmt.COMMITTED for steps in out for s in steps):
        raise errors[0][2]
    for name, st, err in errors:
        log.error(
            "the %s tier %s cannot be listed (%s: %s); loading from the other tiers",
            name,
            st.url,
            type(err).__name__,
            err,
        )
    return out


_RANK = {ckfmt.COMMITTED: 0, ckfmt.QUARANTINED: 1, ckfmt.INVALID: 2, ckfmt.INCOMPLETE: 3}


def _best(listings: Sequence[list[ckfmt.StepInfo]]) -> list[ckfmt.StepInfo]:
    best: dict[int, ckfmt.StepInfo] = {}
    for steps in listings:
        for s in steps:
            old = best.get(s.step)
            if old is None or _RANK.get(s.status, 9) < _RANK.get(old.status, 9):
                best[s.step] = s
    return [best[k] for k in sorted(best)]


def tier_steps(tiers: Sequence[Tier]) -> list[ckfmt.StepInfo]:
    """Each step's best status over the tiers (COMMITTED when any tier holds it whole)."""
    return _best(_listings(tiers))


@dataclasses.dataclass(frozen=True)
class _Line:
    """The live line as this rank sees it over the tiers: for each of its steps, the tiers
    whose copy is committed (`held`) and the step's commit time in microseconds (`key`:
    the same on every rank, from the same manifest bytes, and older towards the tail)."""

    held: dict[int, list[str]]
    key: dict[int, int]

    def step_of(self, key: int) -> int:
        return next((s for s, k in self.key.items() if k == key), -1)


def live_holders(tiers: Sequence[Tier]) -> _Line:
    """The committed (not quarantined) copies of the live line's steps, over the tiers."""
    listings = _listings(tiers)
    best = {s.step: s for s in _best(listings)}
    line = ckfmt.line_of(best.values())
    out: dict[int, list[str]] = {}
    for (name, _), steps in zip(tiers, listings, strict=True):
        for s in steps:
            if s.status == ckfmt.COMMITTED:
                out.setdefault(s.step, []).append(name)
    held = {k: out[k] for k in line if k in out}
    key = {}
    for k in held:
        got = best[k].line
        key[k] = int(got.saved_unix * 1e6) if got is not None else 0
    return _Line(held, key)


def _agreed_newest(line: _Line, below: int | None) -> int:
    """The newest step of the live line committed before `below` (a key; None: any) that
    every rank sees committed in some tier; -1 when there is none. A collective: every rank
    calls it with its own `line`. Steps are compared by commit time (`_Line.key`), which is
    the same on every rank, as step numbers are not along a line that rolled back.

    Every rank's view, not any rank's: a step that some rank sees quarantined (a marker a
    peer, the coordinator or an operator wrote) or does not see at all (a listing that lags
    a commit, a tier it cannot reach) is skipped by all of them. So no rank is made to read
    a step it knows is bad, a marker is never overruled by a rank that has not seen it yet,
    and no rank reads a whole step that another cannot load; the cost is at most an older
    whole step. The ranks then load the agreed step by explicit step, ignoring markers, so
    a marker one rank writes while the others read cannot split them.
    """
    keys = set(line.key.values())
    bound = line.key[below] if below is not None else None
    while True:
        mine = max((k for k in keys if bound is None or k < bound), default=-1)
        # No rank holds anything in (candidate, bound): the smallest of the ranks' newest.
        candidate = agree_min(mine)
        if candidate < 0 or agree_min(int(candidate in keys)):
            return line.step_of(candidate) if candidate >= 0 else -1
        bound = candidate


@dataclasses.dataclass
class _Failure:
    step: int
    where: str  # "of URL" (one tier) or "in the mirror tier (URL)"
    reason: str
    error: BaseException | None  # None: another rank's failure
    quarantined: bool = False
    unhealthy: bool = False  # refused by require_finite: its stats count NaN or Inf


def load_from_tiers(
    tiers: Sequence[Tier],
    state: Any,
    *,
    step: int | None = None,
    strict: bool = True,
    keys: str | Sequence[str] | None = None,
    cast: bool = False,
    fallback: bool = True,
    rank: int = 0,
    threads: int | None = None,
    on_quarantine: Callable[[str, int, str], None] | None = None,
    catalog_blake3: Callable[[int], str | None] | None = None,
    read: str = "auto",
    loader: Callable[[Storage, int], Any] | None = None,
    require_finite: bool = False,
) -> LoadResult:
    """Load `step` (default: the live line's head) into `state` from the nearest tier that
    holds a copy that verifies; the policy is the module docstring's.

    tiers: [(name, Storage), ...] nearest first; a job without a mirror is one tier.
    With fallback and no explicit step, every rank of an initialized process group must
    call this. catalog_blake3(step): the manifest digest the coordinator's catalog recorded
    at commit (None: storage alone is trusted); a manifest that differs is damage, in any
    tier (a mirror's manifest is the same bytes as the local one).
    read: "auto" (shared when the load chooses its step under a process group), "shared"
    (every rank of the process group must call this, also with an explicit step) or
    "each" (every rank reads what it needs from storage itself).
    loader(storage, step): in place of ckpt's own planner, an integration that plans and
    reads a step itself (DCP's load): it returns an object whose read(reads) loads the step
    and gives its LoadResult, raising CorruptCheckpoint for damage; `state`, `strict`,
    `keys` and `cast` are then its business. Only with read="each".
    require_finite: refuse a step whose stats count NaN or Inf values in a tensor the load
    selects (`keys`), as the module docstring says; not with a loader.
    """
    if not tiers:
        raise ValueError("load_from_tiers needs at least one (name, Storage) tier")
    if read not in READ_MODES:
        raise ValueError(f"read must be one of {', '.join(READ_MODES)}, got {read!r}")
    if loader is not None and read != "each":
        raise ValueError("a loader reads the step itself: pass read='each'")
    if loader is not None and require_finite:
        raise ValueError("require_finite is ckpt's own load's; a loader plans the step itself")
    check = _finite_check(keys) if require_finite else None
    t0 = time.perf_counter()
    choose = step is None and fallback
    # An explicit step is asked of every tier: nothing to list.
    unlisted: Exception | None = None
    line = _Line({}, {})
    try:
        if step is None:
            line = live_holders(tiers)
    except Exception as e:  # noqa: BLE001 - raised below, once the peers know
        if not choose:
            raise
        # The peers wait in the first agreement: take part holding nothing (so every rank
        # stops), then raise this rank's own error.
        unlisted = e
    held = line.held
    if step is not None:
        at = layout.check_step(step)
    elif choose:
        at = _agreed_newest(line, None)
        if unlisted is not None:
            raise unlisted
    else:
        at = next(iter(held), -1)  # fallback=False: this rank's head, no collective
    if at < 0 and not held:
        ckfmt.resolve_step(tiers[0][1], None)  # raises CheckpointNotFound with the details
        raise CheckpointNotFound(f"{_names(tiers)}: no tier holds a committed step")
    if at < 0:
        raise CheckpointNotFound(
            f"{_names(tiers)}: this rank sees committed steps {sorted(held)[-5:]}, but no "
            "step is committed in every rank's view (another rank sees none of them; see "
            "its log). Nothing was loaded; check that every rank reaches the same storage"
        )
    peers = _shared.Peers.current() if read == "shared" or (read == "auto" and choose) else None

    def prepare(st: Storage, s: int) -> PreparedStep:
        if loader is not None:
            return loader(st, s)
        return prepare_step(
            st,
            state,
            s,
            strict=strict,
            keys=keys,
            cast=cast,
            rank=rank,
            manifest_blake3=catalog_blake3(s) if catalog_blake3 is not None else None,
            check=check,
        )

    failures: list[_Failure] = []
    while True:
        res, mine = (_try_step if peers is None else _try_step_shared)(
            tiers,
            held,
            at,
            explicit=step is not None,
            quarantine=choose,
            on_quarantine=on_quarantine,
            prepare=prepare,
            reader=_Reader(peers, threads),
            rank=rank,
        )
        code = _OK if res is not None else _FAILED if _hard(mine) is not None else _NEXT
        agreed = agree_max(code) if choose else code
        if agreed == _FAILED:
            hard = _hard(mine)
            if hard is not None:
                raise hard
            raise CkptError(
                f"{_names(tiers)} step {at}: another rank failed to load it (see its log); "
                "this rank's load is abandoned so that all ranks stay at the same step"
            ) from next((f.error for f in mine if f.error is not None), None)
        if agreed == _OK and res is not None:
            return _finish(res, failures + mine, t0)
        if not mine:  # this rank loaded the step; another could not
            mine = [
                _Failure(
                    at,
                    f"of {_names(tiers)}",
                    f"another rank found step {at} corrupt or unreadable (see its log)",
                    None,
                )
            ]
        failures += mine
        if not choose:  # an explicit step, or fallback=False: that step or nothing
            if len(failures) == 1 and failures[0].error is not None:
                raise failures[0].error  # one copy tried: its error names the step and file
            raise _exhausted(tiers, f"no copy of step {at} could be loaded", failures)
        older = _agreed_newest(line, at)
        log.error(
            "CHECKPOINT STEP %d OF %s %s; %s",
            at,
            _names(tiers),
            "HOLDS NON-FINITE VALUES (require_finite)"
            if all(f.unhealthy for f in mine)
            else "COULD NOT BE LOADED",
            f"falling back to step {older}" if older >= 0 else "no older committed step to load",
        )
        if older < 0:
            raise _exhausted(tiers, "no committed step could be loaded", failures)
        at = older


def _try_step(
    tiers: Sequence[Tier],
    held: dict[int, list[str]],
    at: int,
    *,
    explicit: bool,
    quarantine: bool,
    on_quarantine: Callable[[str, int, str], None] | None,
    prepare: Callable[[Storage, int], PreparedStep],
    reader: _Reader,
    rank: int,
) -> tuple[LoadResult | None, list[_Failure]]:
    """This rank's copies of step `at`, nearest first, until one loads (no collective).

    Returns the loaded result (None when no copy loaded) and the copies that failed; a hard
    failure (not damage, not unreadable) ends the step at once and is the last failure.
    """
    failures: list[_Failure] = []
    for name, st in tiers:
        if not explicit and name not in held.get(at, []):
            continue
        try:
            prepared = prepare(st, at)
            res = prepared.read(reader.alone())
            came = _provenance.alone(name, st, _provenance.files_of(prepared))
            return dataclasses.replace(res, tier=name, shard_tiers=came), failures
        except BaseException as e:  # noqa: BLE001 - the caller raises it once the ranks agree
            if _failed(failures, tiers, name, st, at, e, quarantine, on_quarantine, rank):
                return None, failures
    return None, failures


def _try_step_shared(
    tiers: Sequence[Tier],
    held: dict[int, list[str]],
    at: int,
    *,
    explicit: bool,
    quarantine: bool,
    on_quarantine: Callable[[str, int, str], None] | None,
    prepare: Callable[[Storage, int], PreparedStep],
    reader: _Reader,
    rank: int,
) -> tuple[LoadResult | None, list[_Failure]]:
    """_try_step, with the ranks in step: every tier's copy is tried by every rank at once,
    so that a copy every rank planned is read once for the job (ckpt._shared_read).

    Each rank announces, for every tier in order, whether it will read that copy; the
    ranks read it together when all announce the same copy, else each ready rank reads it
    alone. A rank that has loaded (or failed hard) announces "skip" for the rest; the loop
    ends when every rank has loaded or failed hard, or the tiers run out, so every rank
    makes the same collectives.
    """
    peers = reader.peers
    assert peers is not None
    failures: list[_Failure] = []
    res: LoadResult | None = None
    done = False  # loaded, or failed hard: skips the remaining copies
    for name, st in tiers:
        prepared: PreparedStep | None = None
        if not done and (explicit or name in held.get(at, [])):
            try:
                prepared = prepare(st, at)
            except BaseException as e:  # noqa: BLE001 - raised by the caller once agreed
                done = _failed(failures, tiers, name, st, at, e, quarantine, on_quarantine, rank)
        said = _shared.announce(
            peers,
            _shared.Announce("skip", tiers=len(tiers))
            if prepared is None
            else _shared.Announce(
                "ready",
                _shared.copy_identity(prepared.ckpt),
                len(tiers),
                _shared.needs_of(prepared.planner.box_plan(), prepared.ckpt.manifest.block_size),
            ),
        )
        together = _shared.all_ready(peers, said)
        if prepared is not None:
            try:
                came: dict[str, str] = {}  # a shared read fills it: where each file came from
                res = prepared.read(
                    reader.together(said, came, name) if together else reader.alone()
                )
                if not together:
                    came = _provenance.alone(name, st, _provenance.files_of(prepared))
                res = dataclasses.replace(res, tier=name, shard_tiers=came)
                done = True
            except BaseException as e:  # noqa: BLE001 - raised by the caller once agreed
                done = _failed(failures, tiers, name, st, at, e, quarantine, on_quarantine, rank)
        if peers.all_max(0 if done else 1) == 0:
            break
    return res, failures


def _failed(
    failures: list[_Failure],
    tiers: Sequence[Tier],
    name: str,
    st: Storage,
    at: int,
    e: BaseException,
    quarantine: bool,
    on_quarantine: Callable[[str, int, str], None] | None,
    rank: int,
) -> bool:
    """Record a copy that failed (quarantined when damaged and the load may mark it);
    returns whether the failure ends the step for this rank (hard, or non-finite values:
    every tier's copy holds the same bytes)."""
    where = f"of {st.url}" if len(tiers) == 1 else f"in the {name} tier ({st.url})"
    if isinstance(e, NonFiniteCheckpoint):
        failures.append(_Failure(at, where, f"rank {rank}: {e}", e, unhealthy=True))
        log.error("CHECKPOINT STEP %d %s SKIPPED (require_finite): %s", at, where, e)
        return True
    if isinstance(e, CorruptCheckpoint):
        # A read the device refused (EIO, a vanished mount) surfaces as damage caused
        # by an OSError: maybe transient, so it is skipped, never quarantined. Damage
        # another rank found is marked by that rank.
        damaged = not isinstance(e.__cause__, OSError) and not isinstance(e, PeerReadFailed)
    elif isinstance(e, OSError):  # CheckpointNotFound, StorageError: not there, unreachable
        damaged = False
    else:
        failures.append(_Failure(at, where, f"rank {rank}: {e}", e))
        return True
    reason = f"rank {rank}: {e}"
    marked = damaged and quarantine and _quarantine(name, st, at, reason, on_quarantine)
    failures.append(_Failure(at, where, reason, e, marked))
    log.error(
        "CHECKPOINT STEP %d %s %s: %s",
        at,
        where,
        "FAILED VERIFICATION AND IS QUARANTINED"
        if marked
        else "FAILED VERIFICATION"
        if damaged
        else "COULD NOT BE READ; not quarantined",
        reason,
    )
    return False


@dataclasses.dataclass
class _Reader:
    """How a planned copy is read: by this rank alone, or with its peers."""

    peers: _shared.Peers | None
    threads: int | None

    def alone(self) -> Reads:
        return functools.partial(read_planned, threads=self.threads)

    def together(self, said: Sequence[_shared.Announce], came: dict[str, str], tier: str) -> Reads:
        assert self.peers is not None
        return functools.partial(
            _read_together, self.peers, said, threads=self.threads, came=came, tier=tier
        )


def _read_together(
    peers: _shared.Peers,
    said: Sequence[_shared.Announce],
    ck: OpenCheckpoint,
    plan: BoxPlan,
    *,
    threads: int | None,
    came: dict[str, str],
    tier: str,
) -> int:
    stats = _shared.read_shared(ck, plan, peers, said, threads=threads)
    # Where each file's bytes came from: every reader says where it read what it read.
    mine = {f: _provenance.place(tier, ck.storage, f) for f in stats.read_paths}
    places = [json.loads(b) for b in peers.all_gather_bytes(json.dumps(mine).encode())]
    came.update(_provenance.together(ck.storage, stats.readers, places))
    log.debug(
        "step %d: read %d bytes for the job, received %d, sent %d",
        ck.step,
        stats.read_bytes,
        stats.received_bytes,
        stats.sent_bytes,
    )
    return stats.read_bytes


def _hard(failures: list[_Failure]) -> BaseException | None:
    """The failure that ends the load on every rank: neither damage nor unreadable."""
    if failures:
        e = failures[-1].error
        if e is not None and not isinstance(e, (CorruptCheckpoint, OSError, NonFiniteCheckpoint)):
            return e
    return None


def _finite_check(keys: str | Sequence[str] | None) -> Callable[[OpenCheckpoint], None]:
    """require_finite's judgement of an opened step (prepare_step's check): raises
    NonFiniteCheckpoint when a selected tensor's stats count NaN or Inf; warns when some
    have no stats (unknown health: loaded)."""
    patterns = keys_patterns(keys)

    def selected(key: str) -> bool:
        return patterns is None or bool(matching(patterns, key))

    def check(ck: OpenCheckpoint) -> None:
        h = health.check(ck, selected)
        where = f"{ck.storage.url} step {ck.step}"
        if h.nonfinite:
            raise NonFiniteCheckpoint(
                f"{where}: {len(h.nonfinite)} tensor(s) hold non-finite values by the stats "
                f"saved with them ({h.describe()}); refused because the load requires finite "
                "values. `ckptctl inspect --stats` lists them; load the step by number "
                "without require_finite to take it anyway"
            )
        if h.unknown:
            log.warning(
                "%s: %d floating-point tensor(s) have no health stats (saved before ckptd "
                "recorded them, or with CKPT_HEALTH_STATS=0), e.g. %r: their health is "
                "unknown; loading the step anyway (require_finite refuses only known NaN/Inf)",
                where,
                len(h.unknown),
                h.unknown[0].key,
            )

    return check


def _quarantine(
    name: str,
    st: Storage,
    step: int,
    reason: str,
    on_quarantine: Callable[[str, int, str], None] | None,
) -> bool:
    """Mark the copy bad in its tier; a marker already there (a peer's, written while this
    rank read) is kept with its first reason. Returns whether the copy is now marked."""
    try:
        ckfmt.quarantine(st, step, reason)
        if on_quarantine is not None:
            on_quarantine(name, step, reason)
        return True
    except (CkptError, OSError) as e:
        log.error("could not quarantine %s step %d: %s", st.url, step, e)
        return False


def _finish(res: LoadResult, failures: list[_Failure], t0: float) -> LoadResult:
    seconds = time.perf_counter() - t0
    log.info("loaded step %d: %.2f GB in %.2f s", res.step, res.bytes / 1e9, seconds)
    if not failures:
        return dataclasses.replace(res, seconds=seconds)
    reason = "; ".join(f"step {f.step} {f.where}: {f.reason}" for f in failures)
    log.warning("loaded step %d (%s) after: %s", res.step, res.path, reason)
    first = failures[0].step
    quarantined: list[int] = []
    unhealthy: list[int] = []
    for f in failures:
        if f.quarantined and f.step not in quarantined:
            quarantined.append(f.step)
        if f.unhealthy and f.step not in unhealthy:
            unhealthy.append(f.step)
    return dataclasses.replace(
        res,
        seconds=seconds,
        fell_back_from=first if first != res.step else None,
        fallback_reason=reason,
        quarantined=quarantined,
        unhealthy=unhealthy,
    )


def _exhausted(tiers: Sequence[Tier], what: str, failures: list[_Failure]) -> BaseException:
    """The error when nothing loaded: the first failure's type, every copy's story."""
    own = [f.error for f in failures if f.error is not None]
    kind = type(own[0]) if own else CorruptCheckpoint
    sick = any(f.unhealthy for f in failures)
    err = kind(
        f"{_names(tiers)}: {what}; every copy tried failed verification"
        + (", held non-finite values (require_finite)" if sick else "")
        + " or could not be read: "
        + "; ".join(f"step {f.step} {f.where}: {f.reason}" for f in failures)
        + ". Nothing valid was loaded (tensors may hold verified bytes of a failed step); "
        "check the stores with `ckptctl verify --all` and restore from a replica"
        + (", or load a step by number without require_finite" if sick else "")
    )
    err.__cause__ = own[0] if own else None
    return err


def _names(tiers: Sequence[Tier]) -> str:
    if len(tiers) == 1:
        return tiers[0][1].url
    return ", ".join(f"{n} ({s.url})" for n, s in tiers)
