"""save / load: what a training loop calls, as functions of the path.

Each delegates to the class that owns the work: a save goes through a Checkpointer and
so through the job's coordinator (embedded when none is configured), exactly as the saves
of many ranks do, so the catalog always knows what storage holds; it writes the shard
straight from the caller's tensors (nothing runs meanwhile, so nothing is staged), hashes
every block, fsyncs, verifies (re-reading the shard cold with verify="full"), and only
then is the manifest written: the commit point. A failed save removes what it wrote and
leaves earlier checkpoints untouched. A load reads storage alone (promise 6).
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any, overload

from ckpt import _default, _world
from ckpt._checkpointer import Checkpointer, open_on
from ckpt._load import load_from_tiers
from ckpt._pending import PendingSave
from ckpt._restore import LoadResult
from ckpt._results import SaveResult, check_metadata
from ckpt._save_job import SaveOptions
from ckptd.coordinator import retention
from ckptd.format import layout
from ckptd.storage import JobLocation, Storage, open_storage

PathLike = str | os.PathLike[str]


@overload
def save(
    state: Any,
    path: None = None,
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> PendingSave: ...


@overload
def save(
    state: Any,
    path: PathLike,
    *,
    step: int,
    metadata: dict[str, Any] | None = None,
    verify: str | None = None,
    keep_last: int | None = None,
    preallocate: bool | None = None,
    io_threads: int | None = None,
) -> SaveResult: ...


def save(
    state: Any,
    path: PathLike | None = None,
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    verify: str | None = None,
    keep_last: int | None = None,
    preallocate: bool | None = None,
    io_threads: int | None = None,
) -> SaveResult | PendingSave:
    """Save `state` as step `step` of the job at `path`; returns once it is committed.

    verify="full" (default) re-reads the shard bypassing the page cache and checks every
    block's blake3 before committing; verify="size" checks presence and sizes only (the
    bytes are still hashed as they are written, so later verification and loads are checked).
    keep_last=N removes older committed steps beyond the newest N after the commit.

    Without a path, saves through the process-wide default Checkpointer (ckpt.init, or
    $CKPT_PATH) and returns its PendingSave as soon as the state is copied to host memory;
    the step is state["step"] when present, else one past the last one saved or resumed.
    """
    if path is None:
        given = [
            name
            for name, v in (
                ("verify", verify),
                ("keep_last", keep_last),
                ("preallocate", preallocate),
                ("io_threads", io_threads),
            )
            if v is not None
        ]
        if given:
            raise TypeError(
                "ckpt.save(state) without a path saves through the default Checkpointer; "
                f"pass {', '.join(given)} to ckpt.init() instead"
            )
        return _default.save(state, step=step, metadata=metadata)
    if step is None:
        raise TypeError(
            "ckpt.save(state, path) needs step=...; ckpt.save(state) without a path (after "
            "ckpt.init) takes the step from state['step']"
        )
    # Bad input is refused before anything is opened or written.
    layout.check_step(step)
    metadata = check_metadata(metadata)
    cp, owned = _checkpointer_for(path)
    try:
        options = SaveOptions(
            verify=verify or "full",
            keep_last=keep_last,
            # One rank writes every entry, so a blocking save writes straight from the
            # tensors (no staged copy). Several ranks stage as usual: each then writes only
            # the chunks the coordinator assigns it, never a replica another rank writes.
            staging_budget_bytes=0 if cp.world_size == 1 else cp.options.staging_budget_bytes,
            preallocate=preallocate,
            io_threads=io_threads,
        )
        result = cp.save(state, step, metadata=metadata, blocking=True, options=options).wait()
    finally:
        if owned:
            cp.close()
    assert result is not None
    return result


_lock = threading.Lock()
_shared: dict[str, Checkpointer] = {}


def _checkpointer_for(path: PathLike) -> tuple[Checkpointer, bool]:
    """The Checkpointer a module-level save goes through, and whether the caller closes it.

    A Checkpointer this process has open on the job (the default one, or the user's own),
    so the save neither fences it nor needs a coordinator of its own. Else one process alone
    opens one for the save and closes it after, so nothing outlives the call. Several ranks keep one per job for the life of the process: opening one is a
    step every rank takes together (the coordinator's address and the attempt travel
    through the process group's store), which a call on one rank cannot redo alone.
    """
    p = JobLocation.of(path).path
    cp = open_on(p)
    if cp is not None:
        return cp, False
    if _world.rank_and_world()[1] == 1:
        return Checkpointer(p), True
    with _lock:
        cp = _shared.get(p)
        if cp is None or cp.closed:
            if not _shared:
                atexit.register(_close_shared)
            cp = _shared[p] = Checkpointer(p)
        return cp, False


def _close_shared() -> None:
    for cp in _shared.values():
        cp.close()
    _shared.clear()


def apply_retention(storage: Storage, keep_last: int) -> list[int]:
    """Apply the retention rule to a job directory from storage alone; the steps removed.

    The same plan the coordinator carries out (ckptd.coordinator.retention, written in
    docs/concepts.md): committed steps beyond the newest `keep_last`, quarantined steps
    behind them, and unfinished step directories older than the newest committed step.
    Never the newest committed step, nor a manifest it cannot read. It cannot see saves in
    flight: run it where none is (a coordinator's own retention knows them).
    """
    return retention.apply(storage, keep_last)


def load(
    state: Any,
    path: PathLike,
    *,
    step: int | None = None,
    strict: bool = True,
    keys: str | list[str] | None = None,
    cast: bool = False,
    fallback: bool = True,
    io_threads: int | None = None,
    read: str = "auto",
    require_finite: bool = False,
) -> LoadResult:
    """Load step `step` (default: the newest committed) into `state`, in place.

    Tensors in `state` are filled where they are, whatever the world size and sharding at
    save time (a DTensor gets its local shard); keys the checkpoint has and `state`
    lacks are added to its dicts; objects with load_state_dict() receive their state.
    Every byte is checked against its blake3 before it reaches `state`. A mismatch in
    keys, dtypes or shapes raises StateMismatch before anything is modified.

    keys: glob patterns over the saved keys; only those are loaded. strict=False: missing
    and unexpected keys are reported in the result instead of raising. cast=True: load
    into tensors of another dtype. fallback (no explicit step): when the newest step fails
    verification, quarantine it and load the previous one (see docs/restore.md).
    read: under a process group, "auto" reads each stored byte once for the whole job and
    sends it to the ranks that need it when the load chooses its step (every rank calls
    it then); "shared" does so for an explicit step too (every rank must call it);
    "each" has every rank read what it needs itself (docs/restore.md, Shared reads).
    require_finite: refuse a step whose saved health stats count NaN or Inf values in a
    selected tensor (judged from the shard indexes, before a byte is read): with fallback
    and no explicit step the newest finite step is loaded, loudly; an explicit step raises
    NonFiniteCheckpoint. A step saved without stats loads with a warning (unknown health).
    """
    return load_from_tiers(
        [("local", open_storage(path))],
        state,
        step=step,
        strict=strict,
        keys=keys,
        cast=cast,
        fallback=fallback,
        rank=_world.rank_and_world()[0],
        threads=io_threads,
        read=read,
        require_finite=require_finite,
    )
