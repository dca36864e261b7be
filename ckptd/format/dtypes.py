"""Tensor dtypes by their stable on-storage names.

Names are torch's own (`str(dtype)` without the `torch.` prefix) so a manifest reads
naturally; the item size is recorded by the format, not looked up from torch, so a
reader can validate byte lengths before it allocates anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: the coordinator never needs it
    import torch

# name -> item size in bytes. Order is only for documentation.
_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "bool": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}

# Every name is a dtype of the torch versions we support (float8_e8m0fnu and
# float4_e2m1fn_x2 since 2.7); an older torch simply cannot load those entries.
SUPPORTED = tuple(_ITEMSIZE)
_BY_NAME: dict[str, torch.dtype] = {}
_BY_DTYPE: dict[torch.dtype, str] = {}


def _tables() -> None:
    if _BY_NAME:
        return
    import torch

    for name in _ITEMSIZE:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            _BY_NAME[name] = dt
            _BY_DTYPE[dt] = name


def name_of(dtype: torch.dtype) -> str | None:
    """The storage name of a torch dtype, or None when ckptd cannot store it."""
    _tables()
    return _BY_DTYPE.get(dtype)


def from_name(name: str) -> torch.dtype:
    _tables()
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown dtype {name!r}; known: {', '.join(SUPPORTED)}") from None


def itemsize(name: str) -> int:
    try:
        return _ITEMSIZE[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown dtype {name!r}; known: {', '.join(SUPPORTED)}") from None
