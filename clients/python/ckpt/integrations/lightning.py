"""A Lightning CheckpointIO that stores checkpoints as verified ckptd checkpoints.

    from ckpt.integrations.lightning import CkptdCheckpointIO
    trainer = Trainer(plugins=[CkptdCheckpointIO()], ...)

Each checkpoint path Lightning asks for ("ckpts/epoch=3-step=400.ckpt", "last.ckpt")
becomes a ckptd job directory (characters outside ckptd's safe set [A-Za-z0-9._-] become
"_" in its name: "ckpts/epoch_3-step_400.ckpt") holding one committed step (the global step, or one past
the step already there when Lightning overwrites a path): written by ckptd's writer with
blake3 per block, verified by a cold re-read, committed by ckptd's coordinator, then the
previous step of that path is retired. `ckptctl verify/restore` and `ckpt.load` read it.
Lightning saves from global rank 0 only, so the checkpoint is one shard; loads read it
on every rank that asks, every byte checked against its blake3.

Non-tensor values (hyperparameters, loop and callback states) are stored as JSON, never
pickled. A value that is neither a tensor, a numpy array nor a plain value (None, bool,
int, float, str, bytes, lists/tuples/dicts of them) fails the save with an error naming
its key, unless the plug-in was told otherwise: unsupported="str" stores str(value)
instead (it loads back as that string), unsupported="drop" leaves the value out (dict
entries are removed, list items become None); both log each key they changed.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ckpt._flatten import flatten
from ckpt.integrations import _commit, _coordinator
from ckptd.errors import CheckpointNotFound, UnsupportedValue
from ckptd.format import checkpoint as ckfmt
from ckptd.format import values
from ckptd.storage import JobLocation, open_storage

try:  # the unified package first, then the standalone one pytorch_lightning uses
    from lightning.fabric.plugins import CheckpointIO
except ImportError:  # pragma: no cover - depends on what is installed
    from lightning_fabric.plugins import (  # type: ignore[assignment, no-redef, unused-ignore]
        CheckpointIO,
    )

__all__ = ["CkptdCheckpointIO"]

log = logging.getLogger("ckpt")
_DROP = object()
POLICIES = ("raise", "str", "drop")


class CkptdCheckpointIO(CheckpointIO):
    """save_checkpoint / load_checkpoint / remove_checkpoint through ckptd.

    unsupported: "raise" (default), "str" or "drop": what to do with values ckptd cannot
        store without pickle (see the module docstring).
    verify: "full" (re-read and hash before the commit) or "size".
    coordinator / token: a `ckptd serve` address (default $CKPTD_ADDRESS, else an
        embedded coordinator in this process, started for each save).
    """

    def __init__(
        self,
        *,
        unsupported: str = "raise",
        verify: str = "full",
        coordinator: str | None = None,
        token: str | None = None,
        timeout_s: float = 600.0,
    ):
        if unsupported not in POLICIES:
            raise ValueError(f"unsupported must be one of {POLICIES}, got {unsupported!r}")
        if verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
        self.unsupported, self.verify = unsupported, verify
        self.coordinator, self.token, self.timeout_s = coordinator, token, timeout_s

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"CkptdCheckpointIO.save_checkpoint({path!s}): storage_options are not "
                "supported; configure storage through the path (a local path or fsspec URL)"
            )
        job = job_for(path)
        where = f"Lightning checkpoint {job!r}"
        if self.unsupported != "raise":
            checkpoint = _storable(checkpoint, "", self.unsupported, where)
        try:
            node, leaves = flatten(checkpoint)
        except UnsupportedValue as e:
            raise UnsupportedValue(
                f"{where}: {e}. Or let the plug-in convert such values: "
                "CkptdCheckpointIO(unsupported='str') stores str(value), 'drop' leaves them out"
            ) from None
        storage = open_storage(job, create=True)
        newest = ckfmt.latest_step(storage)
        step = int(checkpoint.get("global_step", 0) or 0)
        if newest is not None and step <= newest:
            step = newest + 1  # Lightning overwrites this path: a new step, the old retired
        conn = _coordinator.connect(job, address=self.coordinator, token=self.token, attempt=None)
        try:
            _commit.begin_step(storage, job, step)
            target = _commit.Target(job, step, conn.generation, 0, 1, self.verify, None)
            items = [leaf.write_item(leaf.host_bytes()) for leaf in leaves]
            info, chunks = _commit.write_shard(target, items)
            meta = {"lightning": {"global_step": checkpoint.get("global_step")}}
            _commit.commit(
                conn.client, target, {0: info}, {0: chunks}, node, meta, 1, self.timeout_s
            )
        finally:
            # One embedded coordinator per checkpoint path: do not keep them all running.
            _coordinator.close(job)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The newest committed step of `path` as a plain dict (tensors on the CPU, or on
        map_location when it is a device). weights_only is moot: nothing is unpickled."""
        import ckpt

        job = job_for(path)
        storage = open_storage(job)
        step = ckfmt.latest_step(storage)
        if step is None:
            ckfmt.resolve_step(storage, None)  # raises with what the directory holds
            raise CheckpointNotFound(f"Lightning checkpoint {job!r}: no committed step")
        # An explicit step: no fallback, so no collective (other ranks may not be loading).
        state = ckpt.load({}, job, step=step).state
        if isinstance(map_location, (str, torch.device)):
            state = _to_device(state, torch.device(map_location))
        return dict(state)

    def remove_checkpoint(self, path: Any) -> None:
        job = job_for(path)
        _coordinator.close(job)
        if not JobLocation.of(job).is_url and not os.path.isdir(job):
            return
        storage = open_storage(job)
        for s in ckfmt.list_steps(storage):
            ckfmt.remove_step(storage, s.step)  # manifest first: never a half checkpoint
        storage.remove_tree("")


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def job_for(path: Any) -> str:
    """The ckptd job directory of a Lightning checkpoint path."""
    loc = JobLocation.of(path)
    return f"{loc.parent}/{_UNSAFE.sub('_', loc.name)}"


def _storable(obj: Any, key: str, policy: str, where: str) -> Any:
    """A copy of `obj` with the values ckptd cannot store converted ("str") or dropped."""
    if isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
        return obj
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            kk = _scalar_or(k, f"{key}/{k}", policy, where, is_key=True)
            if kk is _DROP:
                continue
            vv = _storable(v, f"{key}/{kk}", policy, where)
            if vv is not _DROP:
                out[kk] = vv
        return out
    if isinstance(obj, (list, tuple)):
        items = [_storable(v, f"{key}/{i}", policy, where) for i, v in enumerate(obj)]
        items = [None if v is _DROP else v for v in items]
        return tuple(items) if isinstance(obj, tuple) else items
    return _scalar_or(obj, key, policy, where)


def _scalar_or(value: Any, key: str, policy: str, where: str, is_key: bool = False) -> Any:
    try:
        values.encode_scalar(value)
        return value
    except TypeError:
        pass
    what = "dict key" if is_key else "value"
    cls = type(value)
    if policy == "drop":
        log.warning("%s: left out the %s at %r (a %s)", where, what, key, cls.__qualname__)
        return _DROP
    log.warning("%s: stored the %s at %r (a %s) as str()", where, what, key, cls.__qualname__)
    return str(value)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        seq = [_to_device(v, device) for v in obj]
        return tuple(seq) if isinstance(obj, tuple) else seq
    return obj
