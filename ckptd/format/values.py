"""The state tree as JSON: structure and non-tensor values, never pickle.

A node is either a plain JSON scalar (null, true/false, an integer, a finite float, a
string) or an object with exactly one tag:

    {"float": "nan" | "inf" | "-inf"}
    {"bytes": "<base64>"}
    {"list": [node, ...]}           {"tuple": [node, ...]}
    {"dict": [[key node, value node], ...]}     keys may be any scalar node
    {"tensor": "<entry key>"}       a torch.Tensor stored in the shards
    {"tensor": {"key": "<entry key>", "requires_grad": true, "parameter": true,
                "view": {"storage": "<name>", "offset": 0, "stride": [1, 4]}}}
                                    the same, with what a load into a new structure
                                    restores besides the values (every field but "key"
                                    optional; see check_tensor_body)
    {"ndarray": "<entry key>"}      a numpy array stored as a tensor, restored as numpy
    {"npscalar": "<entry key>"}     a numpy scalar (0-d), restored as a numpy scalar
    {"stateful": node}              an object restored through load_state_dict(node)
    {"per_rank": [[rank, node], ...]}   a value that differs per rank (ckpt.PerRank);
                                    each rank restores its own entry

The tag object makes every node unambiguous, whatever keys the user's dicts have.

A tensor's "view" says which tensors shared one storage at save time: every tensor whose
view names the same storage is rebuilt over one buffer on a load into a new structure,
at `offset` (elements of its dtype, from the start of the range the group covers) with
`stride`. Each view's bytes are still its own entry, so every reader that ignores the
field (exports, reshards, in-place loads, older ckptd) reads plain tensors.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ckptd.errors import InvalidManifest

MAX_DEPTH = 256
MAX_DIMS = 64  # dimensions of a tensor (entries' shapes and views' strides)
MAX_OFFSET = 1 << 62  # element offsets and strides of a view
# Views of one storage are rebuilt over the range they cover only while that range is at
# most this many times the bytes they hold: a save records no larger group (those views
# come back independent), a load refuses one, so a load never allocates much more than
# the checkpoint holds, whatever a manifest says.
VIEW_SPAN_FACTOR = 2
TENSOR_TAGS = ("tensor", "ndarray", "npscalar")
_TENSOR_FIELDS = frozenset(("key", "requires_grad", "parameter", "view"))
_VIEW_FIELDS = frozenset(("storage", "offset", "stride"))
_TAGS = frozenset(("float", "bytes", "list", "tuple", "dict", "stateful", "per_rank", *TENSOR_TAGS))


def key_text(k: Any) -> str:
    """A dict key as the user wrote it, as one path component: a string as it is, an int
    in decimal, anything else (a bool, a float, a tuple) as its repr."""
    if isinstance(k, str):
        return k
    return str(k) if isinstance(k, int) and not isinstance(k, bool) else repr(k)


def key_component(k: Any) -> str:
    """A dict key as one component of a stored key: key_text with '%' and '/' escaped (the
    one rule the flatten names keys by, and every reader that maps keys back uses)."""
    return key_text(k).replace("%", "%25").replace("/", "%2F")


def encode_scalar(v: Any) -> Any:
    """JSON node for a scalar, or raise TypeError when `v` is not one."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        if v.bit_length() > 13_000:  # ~3,900 digits, under Python's int<->str limit
            raise TypeError("int with more than 3,900 digits (store it as str or bytes)")
        return int(v)
    if isinstance(v, float):
        if math.isfinite(v):
            return float(v)
        return {"float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"bytes": base64.b64encode(bytes(v)).decode("ascii")}
    raise TypeError(type(v).__name__)


def decode_scalar(node: Any) -> Any:
    if isinstance(node, dict):
        if "float" in node:
            return float(node["float"])
        if "bytes" in node:
            return base64.b64decode(node["bytes"], validate=True)
        raise InvalidManifest(f"not a scalar node: {str(node)[:80]}")
    return node


def check_node(node: Any, where: str = "state", depth: int = 0) -> None:
    """Validate a node tree read from storage (structure, tags, depth), iteratively safe."""
    if depth > MAX_DEPTH:
        raise InvalidManifest(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if node is None or isinstance(node, (bool, int, str)):
        return
    if isinstance(node, float):
        if not math.isfinite(node):
            raise InvalidManifest(f"{where}: bare non-finite float")
        return
    if not isinstance(node, dict) or len(node) != 1:
        raise InvalidManifest(
            f"{where}: expected a scalar or a one-tag object, got {str(node)[:80]}"
        )
    ((tag, body),) = node.items()
    if tag not in _TAGS:
        raise InvalidManifest(f"{where}: unknown tag {tag!r}")
    if tag == "float":
        if body not in ("nan", "inf", "-inf"):
            raise InvalidManifest(f"{where}: bad float {body!r}")
    elif tag == "bytes":
        if not isinstance(body, str):
            raise InvalidManifest(f"{where}: bytes must be base64 text")
        try:
            base64.b64decode(body, validate=True)
        except ValueError:
            raise InvalidManifest(f"{where}: bytes are not valid base64") from None
    elif tag in ("list", "tuple"):
        if not isinstance(body, list):
            raise InvalidManifest(f"{where}: {tag} body must be a list")
        for i, child in enumerate(body):
            check_node(child, f"{where}[{i}]", depth + 1)
    elif tag == "dict":
        if not isinstance(body, list):
            raise InvalidManifest(f"{where}: dict body must be a list of pairs")
        for pair in body:
            if not isinstance(pair, list) or len(pair) != 2:
                raise InvalidManifest(f"{where}: dict items must be [key, value] pairs")
            k, v = pair
            check_node(k, f"{where}.<key>", depth + 1)
            if isinstance(k, dict) and next(iter(k)) not in ("float", "bytes"):
                raise InvalidManifest(f"{where}: dict keys must be scalars")
            check_node(v, f"{where}[{str(k)[:40]}]", depth + 1)
    elif tag == "tensor" and isinstance(body, dict):
        check_tensor_body(body, where)
    elif tag in TENSOR_TAGS:
        if not isinstance(body, str) or not body:
            raise InvalidManifest(f"{where}: {tag} must name an entry key")
    elif tag == "stateful":
        check_node(body, f"{where}", depth + 1)
    elif tag == "per_rank":
        if not isinstance(body, list):
            raise InvalidManifest(f"{where}: per_rank must be a list of [rank, node] pairs")
        for pair in body:
            if (
                not isinstance(pair, list)
                or len(pair) != 2
                or isinstance(pair[0], bool)
                or not isinstance(pair[0], int)
                or pair[0] < 0
            ):
                raise InvalidManifest(f"{where}: per_rank items must be [rank, node] pairs")
            check_node(pair[1], f"{where}@rank{pair[0]}", depth + 1)


def _is_index(v: Any, upper: int = MAX_OFFSET) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < upper


def check_tensor_body(body: dict[str, Any], where: str) -> None:
    """A tensor node's object body: its entry key and the optional fidelity fields."""
    unknown = set(body) - _TENSOR_FIELDS
    if unknown:
        raise InvalidManifest(f"{where}: unknown tensor field(s) {sorted(unknown)[:4]}")
    key = body.get("key")
    if not isinstance(key, str) or not key:
        raise InvalidManifest(f"{where}: tensor must name an entry key")
    for flag in ("requires_grad", "parameter"):
        if flag in body and not isinstance(body[flag], bool):
            raise InvalidManifest(f"{where}: tensor field {flag!r} must be true or false")
    if "view" not in body:
        return
    view = body["view"]
    if not isinstance(view, dict) or set(view) != _VIEW_FIELDS:
        raise InvalidManifest(
            f"{where}: tensor view must be an object with exactly {sorted(_VIEW_FIELDS)}"
        )
    if not isinstance(view["storage"], str) or not view["storage"]:
        raise InvalidManifest(f"{where}: tensor view's storage must be a non-empty string")
    if not _is_index(view["offset"]):
        raise InvalidManifest(
            f"{where}: tensor view's offset {str(view['offset'])[:40]} is not an integer "
            f"in [0, 2**62)"
        )
    stride = view["stride"]
    if (
        not isinstance(stride, list)
        or len(stride) > MAX_DIMS
        or not all(_is_index(x) for x in stride)
    ):
        raise InvalidManifest(
            f"{where}: tensor view's stride must be a list of at most {MAX_DIMS} integers "
            "in [0, 2**62)"
        )


def view_range(offset: int, shape: list[int], stride: list[int]) -> tuple[int, int]:
    """[first, last + 1) elements a view of `shape`/`stride` at `offset` touches
    (an empty range for an empty view)."""
    if any(n == 0 for n in shape):
        return offset, offset
    return offset, offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1


def self_overlaps(shape: list[int], stride: list[int]) -> bool:
    """Whether two elements of a view share memory (an expand()ed or as_strided tensor):
    such a view cannot be written element by element, so it is never rebuilt as one."""
    dims = sorted((s, n) for n, s in zip(shape, stride, strict=True) if n > 1)
    reach = 0  # elements spanned by the dimensions of smaller stride, minus one
    for s, n in dims:
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False


@dataclasses.dataclass
class ViewGroup:
    """Tensors that were views of one storage at save time, rebuilt over one buffer."""

    name: str
    members: dict[str, tuple[int, list[int]]]  # entry key -> (element offset, stride)
    span: int = 0  # bytes from the group's start to the end of its last view
    disjoint: bool = True  # no two views share a byte (each can be read into place)


def view_groups(
    state: Any, geometry: Callable[[str], tuple[list[int], int]], where: str
) -> dict[str, ViewGroup]:
    """Every view group of a (validated) tree, checked against the entries' shapes.

    geometry(key): the entry's (shape, itemsize). Raises InvalidManifest for a view that
    does not fit its entry (stride rank, elements sharing memory), a key placed twice,
    or a group spanning more than VIEW_SPAN_FACTOR times its views' bytes.
    """
    groups: dict[str, ViewGroup] = {}
    placed: dict[str, tuple[str, int, list[int]]] = {}
    ranges: dict[str, list[tuple[int, int]]] = {}
    held: dict[str, int] = {}  # bytes of the views' elements
    for leaf in leaves(state):
        if not (isinstance(leaf, dict) and isinstance(leaf.get("tensor"), dict)):
            continue
        body = leaf["tensor"]
        view = body.get("view")
        if view is None:
            continue
        key, name, offset, stride = body["key"], view["storage"], view["offset"], view["stride"]
        kw = f"{where}: tensor {key!r}"
        if key in placed:
            if placed[key] != (name, offset, stride):
                raise InvalidManifest(f"{kw} is placed twice, differently; the manifest was edited")
            continue
        placed[key] = (name, offset, stride)
        shape, itemsize = geometry(key)
        if len(stride) != len(shape):
            raise InvalidManifest(
                f"{kw}: its view has {len(stride)} strides for {len(shape)} dimensions"
            )
        if self_overlaps(shape, stride):
            raise InvalidManifest(f"{kw}: its view's strides {stride[:8]} overlap its elements")
        g = groups.setdefault(name, ViewGroup(name, {}))
        g.members[key] = (offset, stride)
        first, end = view_range(offset, shape, stride)
        ranges.setdefault(name, []).append((first * itemsize, end * itemsize))
        held[name] = held.get(name, 0) + math.prod(shape) * itemsize
    for name, g in groups.items():
        spans = sorted(r for r in ranges[name] if r[1] > r[0])
        g.span = max((end for _, end in spans), default=0)
        if g.span > VIEW_SPAN_FACTOR * held[name]:
            raise InvalidManifest(
                f"{where}: the views of storage {name[:200]!r} span {g.span} bytes, over "
                f"{VIEW_SPAN_FACTOR}x the {held[name]} bytes they hold; the manifest was edited"
            )
        g.disjoint = all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    return groups


def tensor_key(body: Any) -> str:
    """The entry key of a (validated) tensor reference's body."""
    return body if isinstance(body, str) else str(body["key"])


def leaves(node: Any) -> Iterator[Any]:
    """Every leaf of a (validated) node tree: scalar nodes and tensor references."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            ((tag, body),) = n.items()
            if tag in ("list", "tuple"):
                stack.extend(body)
                continue
            if tag == "dict":
                stack.extend(v for _, v in body)
                continue
            if tag == "stateful":
                stack.append(body)
                continue
            if tag == "per_rank":
                stack.extend(x for _, x in body)
                continue
        yield n


def tensor_ref(leaf: Any) -> tuple[str, str] | None:
    """(tag, key) when a leaf is a tensor reference, else None."""
    if isinstance(leaf, dict):
        ((tag, body),) = leaf.items()
        if tag in TENSOR_TAGS:
            return tag, tensor_key(body)
    return None


def tensor_refs(node: Any) -> Iterator[tuple[str, str]]:
    """(tag, key) of every tensor reference in a (validated) node tree."""
    for leaf in leaves(node):
        ref = tensor_ref(leaf)
        if ref is not None:
            yield ref


def decode(node: Any, tensor: Callable[[str, str], Any]) -> Any:
    """Rebuild plain Python values; `tensor(tag, key)` supplies tensors.

    Stateful nodes decode to their plain state (the object is not recreated: a user
    restoring into a fresh structure gets the state_dict to hand to load_state_dict).
    """
    if not isinstance(node, dict):
        return node
    ((tag, body),) = node.items()
    if tag in ("float", "bytes"):
        return decode_scalar(node)
    if tag == "list":
        return [decode(c, tensor) for c in body]
    if tag == "tuple":
        return tuple(decode(c, tensor) for c in body)
    if tag == "dict":
        return {decode_scalar(k): decode(v, tensor) for k, v in body}
    if tag in TENSOR_TAGS:
        return tensor(tag, tensor_key(body))
    if tag == "stateful":
        return decode(body, tensor)
    if tag == "per_rank":
        return {int(r): decode(n, tensor) for r, n in body}
    raise InvalidManifest(f"unknown tag {tag!r}")


# -- per-rank nodes apart: what every rank shares, and what is each rank's own ---------------
# A save's ranks send trees that are equal except their per-rank nodes. Sent whole, every
# rank's tree differs, and the coordinator parses, checks and merges N trees. Sent apart
# (the tree with each per-rank node emptied, plus the rank's own entries in walk order),
# the N trees are N copies of one byte string: parsed and checked once, merged by filling
# the slots (ckptd.coordinator.planning.merge_states).


def _map_per_rank(node: Any, visit: Callable[[Any], Any]) -> Any:
    """The tree rebuilt with each outermost per-rank node replaced by visit(its body), in
    walk order. A subtree without one is the same object, not a copy: most states have
    none, and a copy was a list a dict entry alive through the save (Python's collector
    counts them)."""
    if not isinstance(node, dict) or len(node) != 1:
        return node
    ((tag, body),) = node.items()
    if tag in ("list", "tuple"):
        kids = [_map_per_rank(c, visit) for c in body]
        if all(m is c for m, c in zip(kids, body, strict=True)):
            return node
        return {tag: kids}
    if tag == "dict":
        kids = [_map_per_rank(v, visit) for _, v in body]
        if all(m is v for m, (_, v) in zip(kids, body, strict=True)):
            return node
        return {"dict": [[k, m] for (k, _), m in zip(body, kids, strict=True)]}
    if tag == "stateful":
        kid = _map_per_rank(body, visit)
        return node if kid is body else {"stateful": kid}
    if tag == "per_rank":
        return visit(body)
    return node


def split_per_rank(node: Any) -> tuple[Any, list[list[Any]]]:
    """(the tree with every per-rank node's entries taken out, the entries of each per-rank
    node in walk order). join_per_rank puts them back."""
    slots: list[list[Any]] = []

    def take(body: Any) -> Any:
        slots.append(body)
        return {"per_rank": []}

    return _map_per_rank(node, take), slots


def count_per_rank(node: Any) -> int:
    """How many per-rank nodes a (validated) tree holds, outermost ones only."""
    return len(split_per_rank(node)[1])


def check_rank_entries(entries: Any, slots: int, where: str) -> None:
    """A rank's per-rank entries (split_per_rank's second part) against a tree of `slots`
    per-rank nodes: one list of [rank, node] pairs a node."""
    if not isinstance(entries, list) or len(entries) != slots:
        n = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise InvalidManifest(
            f"{where}: {n} per-rank entries for a state with {slots} per-rank node(s); the "
            "client sends one list of [rank, node] pairs per per-rank node, in tree order"
        )
    for i, body in enumerate(entries):
        check_node({"per_rank": body}, f"{where}[{i}]", 1)


def join_per_rank(node: Any, entries: Sequence[Sequence[Sequence[Any]]]) -> Any:
    """The tree with its i-th per-rank node holding its own pairs, then entries[j][i] of
    each j in order (an empty entries[j]: none); a rank's first pair wins (a rank restores
    one value), as when whole trees are merged."""
    counter = iter(range(1 << 62))

    def fill(body: Any) -> Any:
        i = next(counter)
        merged, seen = [], set()
        for pair in [*body, *(p for e in entries if e for p in e[i])]:
            if int(pair[0]) not in seen:
                seen.add(int(pair[0]))
                merged.append(pair)
        return {"per_rank": merged}

    return _map_per_rank(node, fill)
