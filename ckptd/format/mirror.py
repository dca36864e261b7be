"""Copying a committed step to another tier (a mirror), verified, manifest last.

Each rank copies its own shard (`copy_shards(..., ranks={r})`), so no process reads
another's files from the local tier (which may be a node's own disk):

    read the source's manifest and this rank's indexes (each checked against the manifest)
    upload the rank's shards and indexes: one bulk fsspec `put` from a local tier
        (concurrent files, multipart parts), else a streamed copy through the Storage seam
    read them back from the mirror: each index's blake3 against the manifest, each
        shard's size, every block's blake3 against the index
    mark each shard verified in the mirror (`<shard>.mirrored`: its size and index blake3)

and one process (rank 0) commits the copy (`commit_copy`): once every shard of the
manifest is marked verified, with the size the manifest says, it writes the manifest,
create-only, and removes the marks. From then on the mirror holds the step.
`mirror_step` is both for one process that holds every shard.

Verification reads the mirror's bytes back rather than re-hashing what was sent: the
source was already verified when it was committed, so what is in doubt is what the
store now holds (a truncated or mangled upload, a proxy rewriting bodies, the wrong
object under the key). Reading back is the only check of that, and it proves the copy
restorable by the same code a load runs. Its cost is a second transfer of the step, off
the training path (bench figures in docs/tiers.md), spread over the ranks.

A step that borrows bytes from earlier steps (an incremental save) is copied as it is,
its indexes naming the lenders' files: the mirror must hold each lender, committed with
the same manifest, first (copied in order they are; one process holding every shard
copies a missing lender itself, `mirror_step`), and its retention keeps them as the
source's does (ckptd.coordinator.retention).

A copy that fails leaves no manifest in the mirror, so it is debris there, never a
checkpoint; a later copy of the step overwrites its files, and retention there removes
a step left uncommitted below the newest.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Collection

from ckptd import knobs
from ckptd.errors import (
    CheckpointExists,
    CkptError,
    CorruptCheckpoint,
    MirrorIncomplete,
    ShardMissing,
)
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, layout
from ckptd.format.manifest import ShardInfo, entry_pieces
from ckptd.format.reader import verify_entries
from ckptd.storage.base import Storage

_COPY_WINDOW = 16 << 20


@dataclasses.dataclass(frozen=True)
class MirrorResult:
    step: int
    bytes: int  # shard + index bytes uploaded (0 when the mirror already held the step)
    upload_s: float
    verify_s: float
    already_there: bool = False


MARK_SUFFIX = ".mirrored"


def _mark(sdir: str, shard: ShardInfo) -> str:
    return f"{sdir}/{shard.path}{MARK_SUFFIX}"


def _mark_body(shard: ShardInfo) -> bytes:
    return json.dumps({"size": shard.size, "index_blake3": shard.index_blake3}).encode()


def mirror_step(src: Storage, dst: Storage, step: int, *, job: str = "") -> MirrorResult:
    """Copy committed `step` of `src` to `dst`, verify it there, then commit it there
    (one process holding every shard: `copy_shards` for all, then `commit_copy`).

    Idempotent: when `dst` already holds the same manifest, nothing is copied. Raises
    CheckpointExists when `dst` holds a different checkpoint under this step,
    CorruptCheckpoint when the read-back does not match, CkptError/OSError on I/O errors.
    """
    res = copy_shards(src, dst, step, job=job)
    if not res.already_there:
        commit_copy(src, dst, step, job=job)
    return res


def copy_shards(
    src: Storage,
    dst: Storage,
    step: int,
    *,
    job: str = "",
    ranks: Collection[int] | None = None,
    replacing: bool = False,
) -> MirrorResult:
    """Copy the shards (and indexes) of `ranks` (None: every rank) of committed `step` to
    `dst`, read them back and verify them there, and mark each verified. Reads only the
    manifest and those ranks' files from `src`. `replacing`: `dst` holds a quarantined copy
    of the step that is giving way to this one (its manifest may still be there while
    another rank removes it: ckpt._mirror), so what `dst` holds is not compared."""
    where = f"job {job or src.url} step {step}"
    sdir = layout.step_dir(step)
    mpath = f"{sdir}/{layout.MANIFEST_NAME}"
    k = knobs.get()
    mdata = src.read_bytes(mpath, limit=k.max_manifest_bytes)
    if not replacing and dst.exists(mpath):
        theirs = dst.read_bytes(mpath, limit=k.max_manifest_bytes)
        if hashing.digest(theirs) == hashing.digest(mdata):
            return MirrorResult(step, 0, 0.0, 0.0, already_there=True)
        raise CheckpointExists(
            f"{where}: the mirror {dst.url}/{sdir} holds a different committed checkpoint "
            "under this step (another job writing to the same mirror path?); it is left "
            "alone. Point the mirror at this job's own prefix, or remove it there"
        )
    m = ckfmt.read_manifest(src, step)
    for lender in m.borrows:
        if not _holds_same(src, dst, lender):
            if ranks is not None:
                raise MirrorIncomplete(
                    f"{where}: borrows bytes from step {lender}, which the mirror {dst.url} "
                    "does not hold (committed with the same manifest); it is not copied here "
                    "until the lender is"
                )
            mirror_step(src, dst, lender, job=job)
    mine = [sh for sh in m.shards if ranks is None or sh.rank in ranks]
    indexes = [ckfmt.read_index(src, m, sh, max_entries=k.max_entries_per_shard) for sh in mine]
    for sh in mine:
        if dst.exists(_mark(sdir, sh)):
            dst.remove_tree(_mark(sdir, sh))  # an earlier copy's: this one is not checked yet
    dst.makedirs(f"{sdir}/{layout.SHARDS_DIR}")
    files = [f"{sdir}/{p}" for sh in mine for p in (sh.path, sh.index)]
    t0 = time.perf_counter()
    put_files = getattr(dst, "put_files", None)
    local = [src.local_path(p) for p in files]  # real files: one concurrent bulk upload
    if put_files is not None and None not in local:
        put_files(list(zip(local, files, strict=True)))
    else:
        for p in files:
            _copy_file(src, dst, p)
    t1 = time.perf_counter()
    problems: list[str] = []
    for shard, index in zip(mine, indexes, strict=True):
        try:
            ckfmt.read_index(dst, m, shard, max_entries=k.max_entries_per_shard)
            ckfmt.check_shard_size(dst, m, shard)
        except CorruptCheckpoint as e:
            problems.append(str(e))
            continue
        problems += [
            f"rank {shard.rank}: {p}"
            for p in verify_entries(
                dst,
                f"{sdir}/{shard.path}",
                [  # the bytes this step holds; its lenders' were verified when copied
                    p
                    for e in index.entries
                    for p in entry_pieces(e, m.block_size)
                    if layout.split_borrowed(p.file) is None
                ],
                m.block_size,
            )
        ]
    t2 = time.perf_counter()
    if problems:
        raise CorruptCheckpoint(
            f"{where}: the copy in the mirror {dst.url}/{sdir} does not match what was "
            f"uploaded: {'; '.join(problems[:5])}. It is not committed there; the upload is "
            "retried with the next checkpoint (check the store's health)"
        )
    for sh in mine:
        dst.write_atomic(_mark(sdir, sh), _mark_body(sh))
    nbytes = sum(sh.size + sh.index_size for sh in mine)
    return MirrorResult(step, nbytes, t1 - t0, t2 - t1)


def commit_copy(
    src: Storage,
    dst: Storage,
    step: int,
    *,
    job: str = "",
    wait_s: float = 0.0,
    give_up: Callable[[], bool] | None = None,
) -> None:
    """Write the manifest of `step` in `dst` once every shard is marked verified there.

    Waits up to `wait_s` for the other ranks' marks (polling, with backoff), or until
    `give_up()` is true; raises MirrorIncomplete naming the ranks still missing."""
    where = f"job {job or src.url} step {step}"
    sdir = layout.step_dir(step)
    mpath = f"{sdir}/{layout.MANIFEST_NAME}"
    m = ckfmt.read_manifest(src, step)
    deadline = time.monotonic() + wait_s
    pause = 0.05
    while True:
        missing = [sh for sh in m.shards if not _marked(dst, sdir, sh)]
        if not missing:
            break
        if time.monotonic() >= deadline or (give_up is not None and give_up()):
            raise MirrorIncomplete(
                f"{where}: the mirror {dst.url}/{sdir} lacks the verified copy of rank(s) "
                f"{', '.join(str(sh.rank) for sh in missing[:8])} after {wait_s:g} s (each "
                "rank uploads its own shard: see those ranks' logs); not committed there, "
                "the next checkpoint is copied in its place"
            )
        time.sleep(pause)
        pause = min(1.0, pause * 2)
    for sh in m.shards:
        ckfmt.check_shard_size(dst, m, sh)
    for lender in m.borrows:
        if not _holds_same(src, dst, lender):
            raise MirrorIncomplete(
                f"{where}: borrows bytes from step {lender}, which the mirror {dst.url} no "
                "longer holds; not committed there"
            )
    mdata = src.read_bytes(mpath, limit=knobs.get().max_manifest_bytes)
    ckfmt.clear_stale_marker(dst, step)
    dst.create_only(mpath, mdata)
    for sh in m.shards:
        try:
            dst.remove_tree(_mark(sdir, sh))
        except (CkptError, OSError):
            pass  # a mark left beside a committed step is a stray for `ckptctl gc`


def _holds_same(src: Storage, dst: Storage, step: int) -> bool:
    """Whether `dst` holds committed `step` with the same manifest bytes as `src`."""
    mpath = f"{layout.step_dir(step)}/{layout.MANIFEST_NAME}"
    limit = knobs.get().max_manifest_bytes
    try:
        theirs = dst.read_bytes(mpath, limit=limit)
    except (ShardMissing, FileNotFoundError):
        return False
    return theirs == src.read_bytes(mpath, limit=limit)


def _marked(dst: Storage, sdir: str, shard: ShardInfo) -> bool:
    try:
        return dst.read_bytes(_mark(sdir, shard), limit=4096) == _mark_body(shard)
    except (ShardMissing, FileNotFoundError):
        return False


def _copy_file(src: Storage, dst: Storage, path: str) -> None:
    """A file through the Storage seam, in windows (any source, any destination)."""
    n = src.size(path)
    r = src.open_read(path)
    w = dst.open_write(path, n)
    try:
        for off in range(0, n, _COPY_WINDOW):
            m = min(_COPY_WINDOW, n - off)
            w.write(off, m, [(off, r.read(off, m).copy())])
        w.finish()
    except BaseException:
        w.abort()
        raise
    finally:
        r.close()
