"""Copying a committed step to another tier (a mirror), verified, manifest last.

    read the source's manifest and indexes (each index checked against the manifest)
    remove debris of an earlier, unfinished copy of the step in the mirror
    upload shards and indexes: one bulk fsspec `put` from a local tier (concurrent files,
        multipart parts), else a streamed copy through the Storage seam
    read everything back from the mirror: each index's blake3 against the manifest, each
        shard's size, every block's blake3 against the index
    write the manifest, create-only: from here on the mirror holds the step

Verification reads the mirror's bytes back rather than re-hashing what was sent: the
source was already verified when it was committed, so what is in doubt is what the
store now holds (a truncated or mangled upload, a proxy rewriting bodies, the wrong
object under the key). Reading back is the only check of that, and it proves the copy
restorable by the same code a load runs. Its cost is a second transfer of the step, off
the training path (bench figures in docs/tiers.md).

A copy that fails leaves no manifest in the mirror, so it is debris there, never a
checkpoint; the next copy of the step clears it first.
"""

from __future__ import annotations

import dataclasses
import time

from ckptd import knobs
from ckptd.errors import CheckpointExists, CorruptCheckpoint
from ckptd.format import checkpoint as ckfmt
from ckptd.format import hashing, layout
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


def mirror_step(src: Storage, dst: Storage, step: int, *, job: str = "") -> MirrorResult:
    """Copy committed `step` of `src` to `dst`, verify it there, then commit it there.

    Idempotent: when `dst` already holds the same manifest, nothing is copied. Raises
    CheckpointExists when `dst` holds a different checkpoint under this step,
    CorruptCheckpoint when the read-back does not match, CkptError/OSError on I/O errors.
    """
    where = f"job {job or src.url} step {step}"
    sdir = layout.step_dir(step)
    mpath = f"{sdir}/{layout.MANIFEST_NAME}"
    k = knobs.get()
    ck = ckfmt.open_checkpoint(src, step)
    mdata = src.read_bytes(mpath, limit=k.max_manifest_bytes)
    if dst.exists(mpath):
        theirs = dst.read_bytes(mpath, limit=k.max_manifest_bytes)
        if hashing.digest(theirs) == hashing.digest(mdata):
            return MirrorResult(step, 0, 0.0, 0.0, already_there=True)
        raise CheckpointExists(
            f"{where}: the mirror {dst.url}/{sdir} holds a different committed checkpoint "
            "under this step (another job writing to the same mirror path?); it is left "
            "alone. Point the mirror at this job's own prefix, or remove it there"
        )
    if dst.exists(sdir):
        dst.remove_tree(sdir)  # an earlier copy that never committed
    dst.makedirs(f"{sdir}/{layout.SHARDS_DIR}")
    files = [f"{sdir}/{p}" for sh in ck.manifest.shards for p in (sh.path, sh.index)]
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
    for shard, index in zip(ck.manifest.shards, ck.indexes, strict=True):
        try:
            ckfmt.read_index(dst, ck.manifest, shard, max_entries=k.max_entries_per_shard)
            ckfmt.check_shard_size(dst, ck.manifest, shard)
        except CorruptCheckpoint as e:
            problems.append(str(e))
            continue
        problems += [
            f"rank {shard.rank}: {p}"
            for p in verify_entries(
                dst, f"{sdir}/{shard.path}", index.entries, ck.manifest.block_size
            )
        ]
    t2 = time.perf_counter()
    if problems:
        raise CorruptCheckpoint(
            f"{where}: the copy in the mirror {dst.url}/{sdir} does not match what was "
            f"uploaded: {'; '.join(problems[:5])}. It is not committed there; the upload is "
            "retried with the next checkpoint (check the store's health)"
        )
    dst.create_only(mpath, mdata)
    nbytes = sum(sh.size + sh.index_size for sh in ck.manifest.shards)
    return MirrorResult(step, nbytes, t1 - t0, t2 - t1)


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
