"""Consolidated export: one committed step as unsharded tensors, for tools outside ckptd.

`ckptctl restore` writes every tensor of a step (or those whose keys match glob patterns)
whole, whatever the sharding at save time, in one of three formats:

- safetensors: one file, written as a stream (the header first, then each tensor at its
  offset), so memory holds one tensor at a time; loads with safetensors.torch.load_file.
- torch: one file of {key: tensor} written by torch.save; loads with
  torch.load(weights_only=True). The tensors are assembled in a memory-mapped scratch file
  beside the output (removed afterwards), so memory holds no more than the page cache.
- zarr: a Zarr v3 hierarchy written with tensorstore (ckptd.export.zarr).

What the formats share (which tensors, the verified reader) is in ckptd.export.reading.

Every tensor is read through ckptd.format.boxes: every block of every chunk is verified
against its blake3 before it is written anywhere. The output appears under its final
name only when complete (written under a temporary name, then renamed); a failed export
(a corrupt block, a full disk) leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ckptd.errors import CkptError
from ckptd.export import zarr as zarr_export
from ckptd.export.reading import Reader, Tensor, header_metadata, select
from ckptd.format import checkpoint as ckfmt
from ckptd.format import dtypes
from ckptd.storage.base import Storage
from ckptd.storage.local import fsync_dir

FORMATS = ("safetensors", "torch", "zarr")

# ckptd dtype name -> safetensors dtype; others cannot be written as safetensors.
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "complex64": "C64",
}


class ExportError(CkptError, ValueError):
    """The export cannot be written as asked (a dtype the format lacks, an existing output)."""


@dataclasses.dataclass
class ExportResult:
    path: str
    format: str
    step: int
    tensors: int
    bytes: int  # tensor bytes written
    bytes_read: int  # bytes read and verified from the checkpoint
    seconds: float
    keys: list[str] = dataclasses.field(default_factory=list)


def _scratch(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# ------------------------------------------------------------------------ safetensors


def write_safetensors(reader: Reader, tensors: Sequence[Tensor], out: str) -> None:
    bad = [f"{t.key} ({t.dtype})" for t in tensors if t.dtype not in SAFETENSORS_DTYPES]
    if bad:
        raise ExportError(
            f"safetensors has no dtype for {', '.join(bad[:10])}; export them with "
            "--format torch or --format zarr, or leave them out with --keys"
        )
    header: dict[str, Any] = {
        "__metadata__": {
            "format": "pt",
            "ckptd": json.dumps(header_metadata(reader.ck), separators=(",", ":")),
        }
    }
    at = 0
    for t in tensors:
        header[t.key] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": t.shape,
            "data_offsets": [at, at + t.nbytes],
        }
        at += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    base = 8 + len(raw)
    buf = np.empty(max((t.nbytes for t in tensors), default=0), dtype=np.uint8)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
        pos = base
        for t in tensors:
            data = reader.read(t, buf[: t.nbytes])
            done = 0
            while done < t.nbytes:
                done += os.pwrite(fd, memoryview(data[done:]), pos + done)  # type: ignore[arg-type]
            pos += t.nbytes
        os.ftruncate(fd, pos)
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ torch


def write_torch(reader: Reader, tensors: Sequence[Tensor], out: str) -> None:
    import torch  # heavy, and only this format needs it: imported when used

    align = 64
    offsets = []
    at = 0
    for t in tensors:
        offsets.append(at)
        at += -(-t.nbytes // align) * align
    scratch = f"{out}.data"
    try:
        mm = np.memmap(scratch, dtype=np.uint8, mode="w+", shape=(max(at, 1),))
        state: dict[str, torch.Tensor] = {}
        for t, off in zip(tensors, offsets, strict=True):
            dt = dtypes.from_name(t.dtype)
            if not t.nbytes:  # its own (empty) storage: no two storages at one address
                state[t.key] = torch.empty(t.shape, dtype=dt)
                continue
            view = reader.read(t, mm[off : off + t.nbytes])
            state[t.key] = torch.from_numpy(np.asarray(view)).view(dt).reshape(t.shape)
        torch.save(state, out)
        with open(out, "rb+") as f:
            os.fsync(f.fileno())
        del state, mm
    finally:
        _remove(scratch)


# ---------------------------------------------------------------------------- export


def export_checkpoint(
    storage: Storage,
    out: str,
    *,
    fmt: str,
    step: int | None = None,
    keys: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
    size_hint: Callable[[int], None] | None = None,
    zarr_keep_bfloat16: bool = False,
    overwrite: bool = False,
    threads: int | None = None,
) -> ExportResult:
    """Write step `step` (default: newest committed) of the job in `storage` to `out`.

    size_hint(total bytes) is called once the tensors are selected (for a progress bar).
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "zarr":
        zarr_export.tensorstore()  # a missing extra is said before anything is read
    t0 = time.perf_counter()
    out = os.path.abspath(out)
    if os.path.lexists(out) and not overwrite:
        raise ExportError(f"{out} exists; remove it or pass --force to replace it")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    ck = ckfmt.open_checkpoint(storage, step)
    # safetensors keeps its header's own entry under "__metadata__": no tensor may be named so.
    tensors = select(ck, keys, reserved=("__metadata__",) if fmt == "safetensors" else ())
    if size_hint is not None:
        size_hint(sum(t.nbytes for t in tensors))
    reader = Reader(ck, progress=progress, threads=threads)
    tmp = _scratch(out)
    _remove(tmp)
    try:
        if fmt == "safetensors":
            write_safetensors(reader, tensors, tmp)
        elif fmt == "torch":
            write_torch(reader, tensors, tmp)
        else:
            zarr_export.write_zarr(reader, tensors, tmp, keep_bfloat16=zarr_keep_bfloat16)
        if os.path.lexists(out):
            _remove(out)
        os.rename(tmp, out)
        fsync_dir(parent)
    except BaseException:
        _remove(tmp)
        raise
    return ExportResult(
        path=out,
        format=fmt,
        step=ck.step,
        tensors=len(tensors),
        bytes=sum(t.nbytes for t in tensors),
        bytes_read=reader.bytes_read,
        seconds=time.perf_counter() - t0,
        keys=[t.key for t in tensors],
    )
