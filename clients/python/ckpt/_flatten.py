"""State <-> (JSON node tree, tensor leaves).

`flatten` walks a user's state (nested dicts/lists/tuples, tensors, numpy arrays, plain
values, and objects with state_dict()/load_state_dict()) and produces the node tree of
ckptd.format.values plus one leaf per distinct tensor. Keys are the path of the leaf,
components joined by '/' ('%' and '/' inside a component are escaped), e.g.
'model/layers.0.weight' or 'optim/state/0/exp_avg'. Two paths that share one tensor
(same storage, offset, shape, strides, dtype) share one leaf, so the bytes are stored once.

Besides the values, a tensor's node records what a load into a new structure needs to
give the tensor back as it was (values.check_tensor_body): requires_grad, whether it was
an nn.Parameter, and, for distinct tensors that are views of one storage (w and w.t(),
slices of one flat buffer), where each sits in that storage, so they share it again. The
bytes stay one entry per view: each key remains a plain tensor to every other reader.

Anything that is not one of those kinds is refused with an error naming its key: there
is no pickle fallback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from ckptd.errors import UnsupportedValue
from ckptd.format import dtypes, values
from ckptd.format.manifest import MAX_KEY_LEN
from ckptd.format.writer import WriteItem


@dataclasses.dataclass
class Leaf:
    key: str
    tag: str  # "tensor" | "ndarray" | "npscalar"
    dtype: str
    shape: list[int]  # global shape
    data: np.ndarray  # the bytes, 1-D uint8, contiguous (a view of the tensor when possible)
    source: Any  # the tensor/array the bytes come from (kept alive while writing)
    chunk_offsets: list[int] = dataclasses.field(default_factory=list)
    chunk_sizes: list[int] = dataclasses.field(default_factory=list)
    nbytes: int = -1  # the tensor's size in bytes (data is empty while on_device)

    @property
    def on_device(self) -> bool:
        return self.data.nbytes < self.nbytes

    def host_bytes(self) -> np.ndarray:
        """The bytes in host memory (copies a device tensor to the CPU)."""
        return tensor_bytes(self.source.cpu()) if self.on_device else self.data

    def write_item(self, data: np.ndarray) -> WriteItem:
        """What the writer needs of this leaf, with its bytes taken from `data`."""
        return WriteItem(
            self.key, self.dtype, self.shape, self.chunk_offsets, self.chunk_sizes, data
        )

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = self.data.nbytes
        if not self.chunk_sizes and self.shape:
            # The whole tensor is its one chunk: its sizes are its shape, the same list
            # (nothing changes either in place; a copy was one more list a tensor alive
            # through the save, which Python's collector counts).
            self.chunk_offsets = [0] * len(self.shape)
            self.chunk_sizes = self.shape


class PerRank:
    """A value that differs per rank, stored per rank and restored to the same rank.

    Without it, a value under one key on several ranks is a replica and must be equal on
    every rank (the save fails loudly when it is not).
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


def is_stateful(obj: Any) -> bool:
    if isinstance(obj, type):  # a class (nn.Linear) is not an object with state
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU tensor as a 1-D uint8 array (a view when contiguous)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dim() and t.stride(-1) == 1 and t.numel():
        # The last dimension dense: the elements viewed as bytes need no flattening first
        # (a flat reshape cost 1.4 us a tensor, in the flatten of every save's stall).
        return t.view(torch.uint8).numpy().reshape(-1)
    return flat_view(t).view(torch.uint8).numpy()


def takes_stored_bytes(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether stored bytes of `dtype` are `t`'s memory as they are (its dtype, dense and
    in order, no conj/neg bit), wherever it lives."""
    return t.dtype == dtype and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def readable_in_place(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether stored bytes of `dtype` can be read straight into `t`'s memory (no staging
    buffer): tensor_bytes(t) is then a view of it, not a copy."""
    return t.device.type == "cpu" and takes_stored_bytes(t, dtype)


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D stride-1 view of a contiguous tensor's elements (same memory).

    torch calls a tensor contiguous while ignoring strides of size-1 dims, so reshape(-1)
    can keep an odd stride (a column of a 1-row matrix); as_strided fixes it, which is
    exact because a contiguous tensor's elements are dense and in order.
    """
    flat = t.reshape(-1)
    if flat.numel() <= 1 and flat.stride() != (1,):
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat


def _numpy_dtype_name(a: np.ndarray) -> str | None:
    if a.dtype.hasobject or a.dtype.fields is not None:
        return None
    name = a.dtype.newbyteorder("=").name if not a.dtype.isnative else a.dtype.name
    try:
        dtypes.itemsize(name)
    except KeyError:
        return None
    return name


_NO_BYTES = np.zeros(0, dtype=np.uint8)

# Group starts are rounded down to this, so every view's byte offset from the start is a
# whole number of its own elements (itemsizes are powers of two up to 16).
_VIEW_ALIGN = 16


class _Placed(NamedTuple):
    """Where one leaf's tensor sits in the storage it shares (bytes and elements). A
    tuple: one is made for each tensor of a state, in the training thread's stall."""

    key: str
    first: int  # byte of its first element
    end: int  # byte after its last element
    nbytes: int  # bytes of its elements (less than end - first for a strided view)
    offset: int  # storage_offset, in elements
    itemsize: int
    stride: tuple[int, ...]


class _Flattener:
    def __init__(self, rank: int = 0, keep_device: bool = False) -> None:
        self.rank = rank
        self.keep_device = keep_device
        self.leaves: list[Leaf] = []
        self.keys: set[str] = set()
        self.by_storage: dict[tuple[Any, ...], str] = {}
        # (device, storage pointer) -> the leaf that is a view of that storage, or the
        # distinct leaves when several are; key -> its tensor node, and its further nodes
        # when the same tensor is under several keys. A list is made only for a second:
        # one a tensor, alive through the flatten, is what Python's collector promotes and
        # walks (bench/README.md, twenty-seventh pass).
        self.storages: dict[tuple[Any, ...], _Placed | list[_Placed]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.more_nodes: dict[str, list[dict[str, Any]]] = {}

    def unique_key(self, path: list[str]) -> str:
        key = "/".join(path) or "."
        if "\0" in key or len(key) > MAX_KEY_LEN - 16:
            raise UnsupportedValue(
                f"state key {key[:120]!r}: keys must be under {MAX_KEY_LEN - 16} characters and "
                "contain no NUL; rename the dict keys on this path"
            )
        if key in self.keys:
            n = 1
            while f"{key}#{n}" in self.keys:
                n += 1
            key = f"{key}#{n}"
        self.keys.add(key)
        return key

    def walk(self, obj: Any, path: list[str], seen: set[int]) -> Any:
        where = "/".join(path) or "<root>"
        if len(path) > values.MAX_DEPTH // 2:
            raise UnsupportedValue(
                f"state key {where[:200]!r}: nested deeper than {values.MAX_DEPTH // 2} levels; "
                "flatten the structure"
            )
        if isinstance(obj, torch.Tensor):
            return self.tensor_node(obj, path, where)
        if isinstance(obj, np.ndarray):
            return {"ndarray": self.ndarray(obj, path, where, "ndarray")}
        if isinstance(obj, np.generic):
            return {"npscalar": self.ndarray(np.asarray(obj), path, where, "npscalar")}
        if isinstance(obj, PerRank):
            return {
                "per_rank": [[self.rank, self.walk(obj.value, [*path, f"@rank{self.rank}"], seen)]]
            }
        if id(obj) in seen:
            raise UnsupportedValue(f"state key {where!r}: the state contains a reference cycle")
        if is_stateful(obj) and not isinstance(obj, Mapping):
            seen = seen | {id(obj)}
            return {"stateful": self.walk(obj.state_dict(), path, seen)}
        if isinstance(obj, Mapping):
            seen = seen | {id(obj)}
            items = []
            for k, v in obj.items():
                try:
                    knode = values.encode_scalar(k)
                except TypeError:
                    raise UnsupportedValue(
                        f"state key {where!r}: dict key {k!r} of type {type(k).__name__} "
                        "cannot be stored; use str, int, float, bool, None or bytes keys"
                    ) from None
                items.append([knode, self.walk(v, [*path, values.key_component(k)], seen)])
            return {"dict": items}
        if isinstance(obj, (list, tuple)):
            seen = seen | {id(obj)}
            children = [self.walk(v, [*path, str(i)], seen) for i, v in enumerate(obj)]
            return {"tuple" if isinstance(obj, tuple) else "list": children}
        try:
            return values.encode_scalar(obj)
        except TypeError as e:
            if isinstance(obj, int):
                raise UnsupportedValue(f"state key {where!r}: {e}") from None
            raise UnsupportedValue(
                f"state key {where!r}: cannot store a value of type {type(obj).__module__}."
                f"{type(obj).__qualname__}. ckptd stores tensors, numpy arrays, None, bool, int, "
                "float, str, bytes, lists/tuples/dicts of them, and objects with state_dict()/"
                "load_state_dict(); convert it to one of these (there is no pickle fallback)"
            ) from None

    def tensor_node(self, t: torch.Tensor, path: list[str], where: str) -> dict[str, Any]:
        """The node of a tensor: its key, and what a load into {} restores besides values.

        Other subclasses than Parameter are stored as plain tensors: a load never imports
        a class named in storage. A DTensor's attributes are its placement's (not stored).
        """
        if type(t).__name__ == "DTensor":
            return {"tensor": self.dtensor(t, path, where)}
        key = self.tensor(t, path, where)
        body: dict[str, Any] = {"key": key}
        if t.requires_grad:
            body["requires_grad"] = True
        if isinstance(t, torch.nn.Parameter):
            body["parameter"] = True
        node: dict[str, Any] = {"tensor": body if len(body) > 1 else key}
        if self.nodes.setdefault(key, node) is not node:
            self.more_nodes.setdefault(key, []).append(node)
        return node

    def tensor(self, t: torch.Tensor, path: list[str], where: str, *, local: bool = False) -> str:
        """The key of a tensor's leaf (a new leaf unless the same tensor was seen).

        local: a DTensor's local shard (a box of a global tensor; never a view to rebuild).
        """
        if type(t).__name__ == "DTensor":
            return self.dtensor(t, path, where)
        if t.layout != torch.strided:
            raise UnsupportedValue(
                f"state key {where!r}: {t.layout} tensors are not supported; convert with .to_dense()"
            )
        # Each attribute of a tensor is a call into torch (t.device builds a new object):
        # read once, since a state has thousands of tensors and this runs in the stall.
        device, dtype = t.device, t.dtype
        kind = device.type
        if t.is_quantized or t.is_nested or kind == "meta":
            raise UnsupportedValue(
                f"state key {where!r}: quantized, nested and meta tensors are not supported; "
                "dequantize / materialize it first"
            )
        name = dtypes.name_of(dtype)
        if name is None:
            raise UnsupportedValue(
                f"state key {where!r}: dtype {dtype} is not supported; supported: "
                f"{', '.join(dtypes.SUPPORTED)}"
            )
        # The storage is identified before a copy to the CPU, which would give each key a
        # storage of its own (a device tensor under two keys would be stored twice).
        sig: tuple[Any, ...] | None = None
        storage: tuple[Any, ...] | None = None  # set when the leaf may share its storage
        numel = t.numel()
        shape, stride, offset = tuple(t.shape), t.stride(), int(t.storage_offset())
        conj, neg, contiguous = t.is_conj(), t.is_neg(), t.is_contiguous()
        if numel:
            # The conj/neg bits are part of the value: z.conj() is not z.
            sig = (device, t.untyped_storage().data_ptr(), offset, shape, stride, dtype)
            sig += (conj, neg)
            if sig in self.by_storage:
                return self.by_storage[sig]
            # conj/neg views store resolved values, not their storage's bytes; a view
            # whose elements share memory (expand()) cannot be written back element-wise
            # (a contiguous tensor's elements never do)
            if not (
                local
                or conj
                or neg
                or (not contiguous and values.self_overlaps(list(shape), list(stride)))
            ):
                storage = sig[:2]
        # Only CUDA tensors are left for the stager (its side streams are CUDA streams).
        on_device = self.keep_device and kind == "cuda"
        if kind != "cpu" and not on_device:
            t = t.detach().to("cpu")
        key = self.unique_key(path)
        if sig is not None:
            self.by_storage[sig] = key
        if storage is not None:
            item = t.element_size()
            first, end = (
                (offset, offset + numel)
                if contiguous
                else values.view_range(offset, list(shape), list(stride))
            )
            placed = _Placed(key, first * item, end * item, numel * item, offset, item, stride)
            held = self.storages.setdefault(storage, placed)
            if isinstance(held, list):
                held.append(placed)
            elif held is not placed:
                self.storages[storage] = [held, placed]
        if on_device:
            # The stager copies it device-to-host into pinned memory; no host copy here.
            # conj/neg bits are resolved on the device first: a non_blocking D2H copy_ of
            # a conj/neg view applies them to the host destination with conj_physical_ /
            # neg_ right after queuing the memcpy (Copy.cu), racing with the DMA.
            src = t.detach().resolve_conj().resolve_neg().contiguous()
            leaf = Leaf(key, "tensor", name, list(t.shape), _NO_BYTES, src)
            leaf.nbytes = src.numel() * src.element_size()
            self.leaves.append(leaf)
        else:
            self.leaves.append(Leaf(key, "tensor", name, list(shape), tensor_bytes(t), t))
        return key

    def dtensor(self, t: Any, path: list[str], where: str) -> str:
        """A DTensor is one global tensor; this rank holds the box of its local shard."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t.to_local()
        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(local.shape) != tuple(sizes):
            raise UnsupportedValue(
                f"state key {where!r}: DTensor local shard {list(local.shape)} does not match its "
                f"placement ({list(sizes)}); redistribute it before saving"
            )
        key = self.tensor(local, path, where, local=True)
        leaf = self.leaves[-1]
        if leaf.key == key:
            leaf.shape = list(t.shape)
            leaf.chunk_offsets = list(offsets)
            leaf.chunk_sizes = list(sizes)
        return key

    def ndarray(self, a: np.ndarray, path: list[str], where: str, tag: str) -> str:
        name = _numpy_dtype_name(a)
        if name is None:
            raise UnsupportedValue(
                f"state key {where!r}: numpy dtype {a.dtype} is not supported "
                "(object, structured and string arrays cannot be stored without pickle)"
            )
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # ascontiguousarray would turn 0-d into 1-d
        key = self.unique_key(path)
        data = a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, dtype=np.uint8)
        self.leaves.append(Leaf(key, tag, name, list(a.shape), data, a))
        return key

    def record_views(self) -> None:
        """Give each tensor that shares its storage with another leaf its place in it."""
        for group in self.storages.values():
            if not isinstance(group, list):
                continue  # one leaf in its storage
            start = min(p.first for p in group) // _VIEW_ALIGN * _VIEW_ALIGN
            span = max(p.end for p in group) - start
            if span > values.VIEW_SPAN_FACTOR * sum(p.nbytes for p in group):
                continue  # mostly bytes no key holds: restored independently
            name = group[0].key
            for p in group:
                view = {
                    "storage": name,
                    "offset": p.offset - start // p.itemsize,
                    "stride": list(p.stride),
                }
                first = self.nodes.get(p.key)
                for node in [first, *self.more_nodes.get(p.key, ())] if first else ():
                    body = node["tensor"]
                    if isinstance(body, str):
                        node["tensor"] = {"key": body, "view": view}
                    else:
                        body["view"] = view


def flatten(state: Any, rank: int = 0, *, keep_device: bool = False) -> tuple[Any, list[Leaf]]:
    """(node tree, tensor leaves) of a state; raises UnsupportedValue naming the key.

    keep_device: leave accelerator tensors where they are (leaf.on_device; the stager
    copies them into pinned host memory); otherwise they are copied to the CPU here.
    """
    f = _Flattener(rank, keep_device)
    node = f.walk(state, [], set())
    f.record_views()
    return node, f.leaves
