"""The state tree as JSON: structure and non-tensor values, never pickle.

A node is either a plain JSON scalar (null, true/false, an integer, a finite float, a
string) or an object with exactly one tag:

    {"float": "nan" | "inf" | "-inf"}
    {"bytes": "<base64>"}
    {"list": [node, ...]}           {"tuple": [node, ...]}
    {"dict": [[key node, value node], ...]}     keys may be any scalar node
    {"tensor": "<entry key>"}       a torch.Tensor stored in the shards
    {"ndarray": "<entry key>"}      a numpy array stored as a tensor, restored as numpy
    {"npscalar": "<entry key>"}     a numpy scalar (0-d), restored as a numpy scalar
    {"stateful": node}              an object restored through load_state_dict(node)
    {"per_rank": [[rank, node], ...]}   a value that differs per rank (ckpt.PerRank);
                                    each rank restores its own entry

The tag object makes every node unambiguous, whatever keys the user's dicts have.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterator
from typing import Any

from ckptd.errors import InvalidManifest

MAX_DEPTH = 256
TENSOR_TAGS = ("tensor", "ndarray", "npscalar")
_TAGS = frozenset(("float", "bytes", "list", "tuple", "dict", "stateful", "per_rank", *TENSOR_TAGS))


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
            return tag, body
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
        return tensor(tag, body)
    if tag == "stateful":
        return decode(body, tensor)
    if tag == "per_rank":
        return {int(r): decode(n, tensor) for r, n in body}
    raise InvalidManifest(f"unknown tag {tag!r}")
