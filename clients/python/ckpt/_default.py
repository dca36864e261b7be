"""The process-wide default Checkpointer: the shortest form of the API.

    ckpt.init("/ckpts/run42", keep_last=3)   # or CKPT_PATH=/ckpts/run42 in the environment
    start = ckpt.resume(state) or 0
    ...
    ckpt.save(state)                         # step from state["step"], else counted
    ckpt.wait()

One Checkpointer per process, created by init() (or on first use from $CKPT_PATH),
flushed and closed at exit like any other. Everything it does is a Checkpointer method;
this module only holds it and picks the step when the caller gives none.
"""

from __future__ import annotations

import operator
import os
import threading
from collections.abc import Mapping
from typing import Any

from ckpt._checkpointer import Checkpointer
from ckpt._pending import PendingSave
from ckpt._results import SaveResult
from ckptd.errors import CkptError

ENV_PATH = "CKPT_PATH"

_lock = threading.Lock()
_default: Checkpointer | None = None


def init(path: str | os.PathLike[str] | None = None, **options: Any) -> Checkpointer:
    """Create the process-wide default Checkpointer (closing the previous one) and return it.

    path: the job's checkpoint directory; default $CKPT_PATH. options: as for Checkpointer
    (keep_last, save_on_preemption, lease_s, ...).
    """
    global _default
    if path is None:
        path = os.environ.get(ENV_PATH)
        if not path:
            raise CkptError(f"ckpt.init() needs the job's checkpoint path, or {ENV_PATH} set")
    with _lock:
        old, _default = _default, None
        if old is not None:
            old.close()
        _default = Checkpointer(path, **options)
        return _default


def get() -> Checkpointer:
    """The default Checkpointer; created from $CKPT_PATH on first use."""
    cp = _default
    if cp is not None and not cp.closed:
        return cp
    if cp is None and os.environ.get(ENV_PATH):
        return init()
    raise CkptError(
        "no default checkpointer: call ckpt.init(path) first (or set CKPT_PATH), or pass the "
        "path: ckpt.save(state, path, step=...)"
        + (" (the default one was closed)" if cp is not None else "")
    )


def current() -> Checkpointer | None:
    return _default


def step_of(state: Any) -> int | None:
    """state["step"] as an int when the state is a mapping that has one (int, numpy or 0-d tensor)."""
    if isinstance(state, Mapping) and "step" in state:
        try:
            return operator.index(state["step"])
        except TypeError:
            raise CkptError(
                f"state['step'] is {type(state['step']).__name__}, not an integer; pass step="
            ) from None
    return None


def save(
    state: Any,
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    blocking: bool = False,
) -> PendingSave:
    """Save through the default Checkpointer (asynchronous unless blocking=True)."""
    cp = get()
    if step is None:
        step = step_of(state)
    if step is None:
        last = cp.last_step
        if last is None:
            last = cp.latest_step() or 0
        step = last + 1
    return cp.save(state, step, metadata=metadata, blocking=blocking)


def resume(
    state: Any,
    *,
    allow_fresh_start: bool = False,
    strict: bool = True,
    require_finite: bool = False,
) -> int | None:
    """Checkpointer.resume on the default Checkpointer."""
    return get().resume(
        state, allow_fresh_start=allow_fresh_start, strict=strict, require_finite=require_finite
    )


def wait(timeout: float | None = None) -> SaveResult | None:
    """Wait for the default Checkpointer's save in flight; its result, or None when none."""
    cp = _default
    if cp is None or cp.closed:
        return None
    return cp.wait(timeout)
