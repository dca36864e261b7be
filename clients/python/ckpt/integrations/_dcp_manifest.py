"""DCP's Metadata <-> ckptd's manifest: no pickle on either side.

DCP describes a checkpoint with a Python object graph (`Metadata`: for every flattened
fqn, tensor chunks or a bytes item; `planner_data`: the fqn's path in the nested state
dict) that its own FileSystemWriter pickles into `.metadata`. ckptd writes none of it:

- the nested state tree of the manifest is rebuilt from the paths, so `ckpt.load` and
  `ckptctl restore` see the same structure a `ckpt.save` of that state dict would give:
  tensors as {"tensor": key} with the key ckpt uses ('model/layers.0.weight'), bytes
  items as plain JSON values (ckpt.integrations._plain);
- tensor chunk geometry (offsets, sizes), dtype and global shape live in the shard
  indexes, like every ckptd entry;
- what only DCP needs (each fqn's path and key, which bytes items were io.BytesIO) is a
  JSON section under the manifest's metadata["dcp"].

`metadata_from` rebuilds DCP's Metadata from those, validating the section first: it
comes from storage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptd.errors import InvalidManifest, UnsupportedValue
from ckptd.format import dtypes, layout, values
from ckptd.format.checkpoint import OpenCheckpoint
from ckptd.format.manifest import MAX_KEY_LEN

SECTION = "dcp"
SECTION_VERSION = 1
PLAIN, BYTES_IO = "plain", "bytesio"

Path = tuple[str | int, ...]


def path_of(fqn: str, planner_data: Any) -> Path:
    """The fqn's path in the nested state dict (DCP's flatten mapping), else (fqn,)."""
    if isinstance(planner_data, dict):
        p = planner_data.get(fqn)
        if isinstance(p, (tuple, list)) and p and all(isinstance(c, (str, int)) for c in p):
            return tuple(p)
    return (fqn,)


def key_of(path: Path) -> str:
    """The ckptd entry key of a path: what ckpt.save would name the same leaf."""
    return "/".join(values.key_component(c) for c in path) or "."


def build_tree(leaves: Iterable[tuple[Path, Any]], where: str) -> Any:
    """The nested node tree holding each leaf node at its path (dicts; lists for 0..n-1)."""
    root: dict[Any, Any] = {}
    for path, node in leaves:
        cur = root
        for i, c in enumerate(path):
            nxt = cur.get(c)
            if isinstance(nxt, _Leaf) or (i == len(path) - 1 and nxt is not None):
                raise UnsupportedValue(
                    f"{where}: DCP path {list(path)[:20]} collides with another one "
                    "(a value and a container at the same place of the state dict)"
                )
            if i == len(path) - 1:
                cur[c] = _Leaf(node)
            else:
                cur = cur.setdefault(c, {})
    return _to_node(root)


class _Leaf:
    __slots__ = ("node",)

    def __init__(self, node: Any):
        self.node = node


def _to_node(level: Any) -> Any:
    if isinstance(level, _Leaf):
        return level.node
    keys = list(level)
    if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
        return {"list": [_to_node(level[i]) for i in range(len(keys))]}
    return {"dict": [[k, _to_node(v)] for k, v in level.items()]}


MISSING = object()


def node_at(tree: Any, path: Sequence[str | int]) -> Any:
    """The node at `path` of a tree made by build_tree, or MISSING."""
    node = tree
    for c in path:
        if not isinstance(node, dict) or len(node) != 1:
            return MISSING
        ((tag, body),) = node.items()
        if tag == "list" and isinstance(c, int) and 0 <= c < len(body):
            node = body[c]
        elif tag == "dict":
            node = next((v for k, v in body if k == c and type(k) is type(c)), MISSING)
        else:
            return MISSING
    return node


def section(
    version: str | None,
    tensors: dict[str, tuple[Path, str]],
    objects: dict[str, tuple[Path, str]],
) -> dict[str, Any]:
    """metadata["dcp"]: fqn -> {"path", "key"} for tensors, {"path", "value"} for bytes items."""
    fqns: dict[str, Any] = {}
    for fqn, (path, key) in tensors.items():
        fqns[fqn] = {"path": list(path), "key": key}
    for fqn, (path, kind) in objects.items():
        fqns[fqn] = {"path": list(path), "value": kind}
    return {"version": SECTION_VERSION, "dcp_version": version, "fqns": fqns}


def metadata_from(ck: OpenCheckpoint) -> tuple[Metadata, dict[str, str], dict[str, Any]]:
    """DCP's Metadata of a committed step, {fqn: key}, and {fqn: (bytes-io?, node)}."""
    where = f"{ck.storage.url}/{layout.step_dir(ck.step)}/{layout.MANIFEST_NAME}"
    sec = ck.manifest.metadata.get(SECTION)
    if sec is None:
        raise InvalidManifest(
            f"{where}: step {ck.step} was not written through ckpt.integrations.dcp (its "
            "manifest has no 'dcp' section); load it with ckpt.load instead of dcp.load"
        )
    if not isinstance(sec, dict) or sec.get("version") != SECTION_VERSION:
        raise InvalidManifest(
            f"{where}: unknown 'dcp' section version {str(sec)[:60]}; upgrade ckptd to read it"
        )
    fqns = sec.get("fqns")
    if not isinstance(fqns, dict):
        raise InvalidManifest(f"{where}: the 'dcp' section has no fqns table")
    md: dict[str, Any] = {}
    planner_data: dict[str, Path] = {}
    keys: dict[str, str] = {}
    objects: dict[str, Any] = {}
    for fqn, info in fqns.items():
        fw = f"{where}: DCP fqn {fqn[:200]!r}"
        path = info.get("path") if isinstance(info, dict) else None
        if (
            not isinstance(path, list)
            or not path
            or len(path) > 256
            or not all(isinstance(c, (str, int)) and not isinstance(c, bool) for c in path)
            or len(fqn) > MAX_KEY_LEN
        ):
            raise InvalidManifest(f"{fw}: needs a path of strings and integers")
        planner_data[fqn] = tuple(path)
        if "key" in info:
            key = info["key"]
            if not isinstance(key, str) or key not in ck.chunks:
                raise InvalidManifest(f"{fw}: tensor key {str(key)[:200]!r} is in no shard index")
            keys[fqn] = key
            entries = [c.entry for c in ck.chunks[key]]
            first = entries[0]
            try:
                dtype = dtypes.from_name(first.dtype)
            except KeyError as e:
                raise InvalidManifest(f"{fw}: {e.args[0]}") from None
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=torch.Size(first.shape),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(e.chunk_offsets), sizes=torch.Size(e.chunk_sizes)
                    )
                    for e in entries
                ],
            )
        elif info.get("value") in (PLAIN, BYTES_IO):
            node = node_at(ck.manifest.state, path)
            if node is MISSING:
                raise InvalidManifest(f"{fw}: no value at path {path[:20]} of the state tree")
            objects[fqn] = (info["value"] == BYTES_IO, node)
            md[fqn] = BytesStorageMetadata()
        else:
            raise InvalidManifest(f"{fw}: neither a tensor key nor a plain value")
    dcp_version = sec.get("dcp_version")
    meta = Metadata(
        state_dict_metadata=md,
        planner_data=planner_data,
        storage_meta=StorageMeta(checkpoint_id=f"{ck.storage.url}/{layout.step_dir(ck.step)}"),
        version=dcp_version if isinstance(dcp_version, str) else None,
    )
    return meta, keys, objects
