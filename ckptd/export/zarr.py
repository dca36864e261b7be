"""Zarr v3 export, written with tensorstore, readable by zarr-python.

Layout: one hierarchy; each tensor is an array at the path of its key ('model/0.weight'
is array '0.weight' in group 'model'); every group has its zarr.json, the root's
attributes hold the step's job, step, world size and user metadata. Arrays use the
sharding codec: inner chunks of at most 16 MiB (partial reads stay cheap) inside shards of
up to 1 GiB, so a large tensor is a handful of files, not thousands (parallel
filesystems suffer from many small files).

Data types: Zarr v3's core types are used as they are (bool, int8..int64, uint8..uint64,
float16/32/64, complex64/128). Everything else (bfloat16, the float8 and float4 types,
complex32) is stored losslessly as its raw bits in the unsigned integer of the same size
(uint16 for bfloat16, uint8 for float8), and the array's attributes say so:

    {"ckptd": {"key": "model/0.weight", "dtype": "bfloat16", "encoding": "raw-bits"}}

A reader restores the value with e.g. `torch.from_numpy(a).view(torch.bfloat16)` or
`a.view(ml_dtypes.bfloat16)`. Why not tensorstore's own bfloat16: zarr-python 3.1 refuses
it ("No Zarr data type found that matches 'bfloat16'") and one such array breaks listing
the whole group. keep_bfloat16=True writes tensorstore's bfloat16 anyway, for tensorstore
and JAX readers (attributes then say "encoding": "native").
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ckptd.errors import CkptError
from ckptd.export.reading import Reader, Tensor, header_metadata
from ckptd.format import dtypes

CORE_TYPES = {
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
}
INNER_CHUNK_BYTES = 16 << 20
SHARD_BYTES = 1 << 30


def node_path(key: str) -> list[str]:
    """A key's components as zarr node names (names zarr forbids get a '_' prefix)."""
    out = []
    for part in key.split("/"):
        if part in ("", ".", "..") or part.startswith("__"):
            part = "_" + part
        out.append(part)
    return out


def chunking(shape: Sequence[int], itemsize: int) -> tuple[list[int], list[int]]:
    """(shard shape, inner chunk shape) for an array of `shape`."""
    inner = [max(1, n) for n in shape]
    while math.prod(inner) * itemsize > INNER_CHUNK_BYTES and max(inner) > 1:
        d = inner.index(max(inner))
        inner[d] = -(-inner[d] // 2)
    counts = [-(-max(1, n) // c) for n, c in zip(shape, inner, strict=True)]
    outer = [c * k for c, k in zip(inner, counts, strict=True)]  # the whole array
    if math.prod(outer) * itemsize > SHARD_BYTES and outer:
        # Shard along the outermost dims: as many inner chunks per shard as fit.
        per = max(1, SHARD_BYTES // (math.prod(inner) * itemsize))
        outer = list(inner)
        for d in range(len(shape)):
            k = min(counts[d], per)
            outer[d] = inner[d] * k
            per //= k
            if per <= 1:
                break
    return outer, inner


INSTALL_HINT = "pip install 'ckptd[export]'"


class MissingExtra(CkptError):
    """An optional extra that a command needs is not installed."""


def tensorstore() -> Any:
    """The tensorstore module, or an error that names the extra to install.

    Imported when a zarr export is asked for, not with ckptd: it belongs to the optional
    `export` extra, and an installed wheel without it must say so, not die on an import."""
    try:
        import tensorstore as ts  # the optional `export` extra (docstring)
    except ImportError as e:
        raise MissingExtra(
            f"ckptctl restore --format zarr needs tensorstore, which is not installed ({e}); "
            f"install the export extra: {INSTALL_HINT}"
        ) from None
    return ts


def storage_dtype(dtype: str, keep_bfloat16: bool) -> tuple[str, Any, str]:
    """(zarr data_type name, numpy dtype to write, encoding) for a ckptd dtype."""
    if dtype in CORE_TYPES:
        return dtype, np.dtype(dtype), "native"
    if dtype == "bfloat16" and keep_bfloat16:
        return "bfloat16", tensorstore().bfloat16.numpy_dtype, "native"
    bits = 8 * dtypes.itemsize(dtype)
    return f"uint{bits}", np.dtype(f"uint{bits}"), "raw-bits"


def _write_group(path: str, attributes: dict[str, Any]) -> None:
    os.makedirs(path, exist_ok=True)
    doc = {"zarr_format": 3, "node_type": "group", "attributes": attributes}
    with open(os.path.join(path, "zarr.json"), "w") as f:
        json.dump(doc, f)


def write_zarr(
    reader: Reader, tensors: Sequence[Tensor], out: str, *, keep_bfloat16: bool = False
) -> None:
    ts = tensorstore()
    _write_group(out, {"ckptd": header_metadata(reader.ck)})
    groups: set[tuple[str, ...]] = {()}
    arrays: set[tuple[str, ...]] = set()
    for t in tensors:
        parts = tuple(node_path(t.key))
        if parts in arrays or parts in groups:
            raise CkptError(f"key {t.key!r} maps to zarr path {'/'.join(parts)} twice")
        for i in range(1, len(parts)):
            g = parts[:i]
            if g in arrays:
                raise CkptError(f"key {t.key!r} nests under the array {'/'.join(g)}")
            if g not in groups:
                _write_group(os.path.join(out, *g), {})
                groups.add(g)
        arrays.add(parts)
    buf = np.empty(max((t.nbytes for t in tensors), default=0), dtype=np.uint8)
    ctx = ts.Context({"file_io_concurrency": {"limit": 8}})
    for t in tensors:
        name, np_dtype, encoding = storage_dtype(t.dtype, keep_bfloat16)
        itemsize = dtypes.itemsize(t.dtype)
        outer, inner = chunking(t.shape, itemsize)
        codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if t.shape and outer != inner:
            codecs = [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": inner,
                        "codecs": codecs,
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                    },
                }
            ]
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": os.path.join(out, *node_path(t.key))},
            "metadata": {
                "shape": t.shape,
                "data_type": name,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": outer}},
                "codecs": codecs,
                "attributes": {"ckptd": {"key": t.key, "dtype": t.dtype, "encoding": encoding}},
            },
            "create": True,
            "delete_existing": True,
        }
        arr = ts.open(spec, context=ctx).result()
        data = reader.read(t, buf[: t.nbytes])
        if t.nbytes:
            arr.write(data.view(np_dtype).reshape(t.shape)).result()
        del arr
