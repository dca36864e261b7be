"""Plain Python values <-> JSON nodes of ckptd.format.values, for the integrations.

Frameworks hand us non-tensor values that they would pickle (DCP's bytes items,
Lightning's hyperparameters and callback states). ckptd stores them as JSON nodes
instead: None, bool, int, float (NaN and infinities included), str, bytes, and lists,
tuples and dicts of those (dict keys: scalars). Anything else is refused with
UnsupportedValue naming its key; there is no pickle fallback, so nothing read back can
run code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptd.errors import UnsupportedValue
from ckptd.format import values

PLAIN_TYPES = "None, bool, int, float, str, bytes, and lists/tuples/dicts of them"


def to_node(value: Any, where: str, *, hint: str = "", _depth: int = 0) -> Any:
    """The JSON node of a plain value; UnsupportedValue naming `where` otherwise."""
    if _depth > values.MAX_DEPTH // 2:
        raise UnsupportedValue(f"{where}: nested deeper than {values.MAX_DEPTH // 2} levels")
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            try:
                knode = values.encode_scalar(k)
            except TypeError:
                raise UnsupportedValue(
                    f"{where}: dict key {k!r} of type {type(k).__name__} cannot be stored "
                    "without pickle; use str, int, float, bool, None or bytes keys"
                ) from None
            items.append([knode, to_node(v, f"{where}/{k}", hint=hint, _depth=_depth + 1)])
        return {"dict": items}
    if isinstance(value, (list, tuple)):
        tag = "tuple" if isinstance(value, tuple) else "list"
        return {
            tag: [
                to_node(v, f"{where}/{i}", hint=hint, _depth=_depth + 1)
                for i, v in enumerate(value)
            ]
        }
    try:
        return values.encode_scalar(value)
    except TypeError:
        cls = type(value)
        raise UnsupportedValue(
            f"{where}: a value of type {cls.__module__}.{cls.__qualname__} cannot be stored "
            f"without pickle; ckptd stores tensors and plain values ({PLAIN_TYPES}). "
            + (hint or "Convert it to one of these, or leave it out of the state")
        ) from None


def from_node(node: Any) -> Any:
    """The plain value of a node made by to_node (after values.check_node)."""
    return values.decode(node, _no_tensor)


def _no_tensor(tag: str, key: str) -> Any:
    raise UnsupportedValue(f"a plain value refers to stored {tag} {key!r}; the manifest was edited")
