"""save / load: what a training loop calls.

A save flattens the state, lays the tensors out as one shard file, writes it with
parallel positional writes while hashing every block, fsyncs, verifies (re-reading the
shard cold with verify="full"), and only then writes the manifest: the commit point.
A failed save removes what it wrote and leaves earlier checkpoints untouched.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, overload

from ckpt._flatten import flatten
from ckpt._load import load_from_tiers
from ckpt._restore import LoadResult
from ckptd import knobs
from ckptd.errors import UnsupportedValue
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout, recycle
from ckptd.format.manifest import Manifest
from ckptd.format.writer import ShardWriteStats, write_shard
from ckptd.storage import Storage, open_storage

if TYPE_CHECKING:
    from ckpt._pending import PendingSave

log = logging.getLogger("ckpt")

PathLike = str | os.PathLike[str]


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
    staging_s: float = 0.0  # copy into host memory (0 for a blocking single-process save)
    persist_s: float = 0.0  # the background part up to the report (includes write_s, verify_s)
    commit_s: float = 0.0  # from this rank's report (or the manifest write) to COMMITTED
    blocking_s: float = 0.0  # what the training loop waited for

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def log_saved(result: SaveResult, where: str) -> None:
    """One INFO line per committed save (logger "ckpt"), so the timings land in job logs."""
    log.info(
        "%s: committed %.3f GB in %.2f s (%.2f GB/s): blocking %.3f s, staging %.3f s, "
        "persist %.2f s (write %.2f s, verify %.2f s), commit %.2f s",
        where,
        result.bytes / 1e9,
        result.seconds,
        result.gbps,
        result.blocking_s,
        result.staging_s,
        result.persist_s,
        result.write_s,
        result.verify_s,
        result.commit_s,
    )


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _check_metadata(metadata: Any) -> dict[str, Any]:
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
        from ckpt import _default

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
    verify = verify or "full"
    t0 = time.perf_counter()
    layout.check_step(step)
    meta = _check_metadata(metadata)
    rank, world = _world()
    if world != 1 or os.environ.get("CKPTD_ADDRESS"):
        # Many ranks (or a configured service): go through the coordinator.
        cp = _checkpointer_for(path, keep_last=keep_last, verify=verify)
        result = cp.save(state, step, metadata=meta, blocking=True).wait()
        assert result is not None
        return result
    node, leaves = flatten(state)
    storage = open_storage(path, create=True)
    job = os.fspath(path)
    ckfmt.begin_step(storage, step)
    stats = ShardWriteStats()
    try:
        items = [leaf.write_item(leaf.data) for leaf in leaves]
        info = write_shard(
            storage,
            job=job,
            step=step,
            rank=0,
            world_size=1,
            generation=0,
            items=items,
            verify=verify,
            preallocate=preallocate,
            io_threads=io_threads,
            stats=stats,
        )
        k = knobs.get()
        manifest = Manifest(
            job=job,
            step=step,
            generation=0,
            world_size=1,
            block_size=k.block_size,
            alignment=k.alignment,
            shards=[info],
            state=node,
            metadata=meta,
        )
        t_commit = time.perf_counter()
        ckfmt.commit(storage, manifest)
        commit_s = time.perf_counter() - t_commit
    except BaseException:
        # Not committed: remove the debris now; earlier steps are untouched.
        try:
            storage.remove_tree(layout.step_dir(step))
        except OSError:
            log.warning("could not remove the failed save's files at %s", layout.step_dir(step))
        raise
    del leaves  # release references to the caller's tensors
    if keep_last is not None:
        apply_retention(storage, keep_last)
    seconds = time.perf_counter() - t0
    result = SaveResult(
        step=step,
        path=f"{storage.url}/{layout.step_dir(step)}",
        bytes=info.size,
        seconds=seconds,
        write_s=stats.write_s,
        verify_s=stats.verify_s,
        tensors=len(items),
        persist_s=seconds - commit_s,
        commit_s=commit_s,
        blocking_s=seconds,
    )
    log_saved(result, f"job {job!r} step {step}")
    log.debug(
        "job %r step %d: %d tensor(s) in %s (verify=%s)", job, step, len(items), info.path, verify
    )
    return result


_checkpointers: dict[tuple[str, int | None, str], Any] = {}


def _checkpointer_for(path: PathLike, *, keep_last: int | None, verify: str) -> Any:
    """One Checkpointer per job for module-level calls, closed at exit."""
    from ckpt import _default
    from ckpt._checkpointer import Checkpointer

    d = _default.current()
    p = os.fspath(path)
    if "://" not in p:
        p = os.path.realpath(os.path.abspath(p))
    if d is not None and not d._closed and d.path == p:
        return d  # the job's default Checkpointer: one coordinator per job and process
    k = (os.path.realpath(os.fspath(path)), keep_last, verify)
    cp = _checkpointers.get(k)
    if cp is None:
        if not _checkpointers:
            atexit.register(_close_checkpointers)
        cp = _checkpointers[k] = Checkpointer(path, keep_last=keep_last, verify=verify)
    return cp


def _close_checkpointers() -> None:
    for cp in _checkpointers.values():
        cp.close()
    _checkpointers.clear()


def apply_retention(storage: Storage, keep_last: int) -> list[int]:
    """Remove committed steps beyond the newest `keep_last`, and debris older than the newest.

    Never removes the newest committed step, whatever keep_last says.
    """
    if keep_last < 1:
        raise ValueError(
            f"keep_last must be at least 1 (the newest checkpoint is always kept), got {keep_last}"
        )
    steps = ckfmt.list_steps(storage)
    committed = [s.step for s in steps if s.status == ckfmt.COMMITTED]
    if not committed:
        return []
    newest = committed[-1]
    doomed = committed[:-keep_last]
    # Debris is a step directory without a manifest. A manifest this reader cannot parse
    # (a newer format, over a size limit, a transient error) is kept: it may be whole.
    doomed += [s.step for s in steps if s.status == ckfmt.INCOMPLETE and s.step < newest]
    keep_files = knobs.get().recycle_files
    for step in sorted(doomed):
        if step in committed:
            recycle.retire_step(storage, step, keep_files=keep_files)
        else:
            ckfmt.remove_step(storage, step)
    return sorted(doomed)


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
    """
    return load_from_tiers(
        [("local", open_storage(path))],
        state,
        step=step,
        strict=strict,
        keys=keys,
        cast=cast,
        fallback=fallback,
        rank=_world()[0],
        threads=io_threads,
    )
