"""Hugging Face accelerate through ckptd: the training state of an Accelerator, verified.

    from ckpt.integrations.hf import load_state, save_state

    model, opt, sched, data = accelerator.prepare(model, opt, sched, data)
    start = load_state(accelerator, "/ckpts/run42") or 0  # newest committed step, or None
    for step in range(start, steps):
        ...
        if step % 500 == 0:
            save_state(accelerator, "/ckpts/run42", step=step)  # on every process

These replace accelerator.save_state(dir) / accelerator.load_state(dir). They save what
those save (every prepared model, optimizer and scheduler, the objects registered with
accelerator.register_for_checkpointing, and each process's RNG states) with ckpt.save:
blake3-verified shards committed by ckptd's coordinator, replicas (DDP) written once,
nothing pickled. accelerate's own save_state cannot be redirected instead: its
register_save_state_pre_hook hands a hook the model weights only, and it then writes
optimizer, scheduler, sampler and RNG states with torch.save (pickle) whatever the hook
does.

Every process calls save_state / load_state (under torch.distributed they coordinate
through ckptd's coordinator, as ckpt.save and ckpt.load do). load_state before
accelerator.prepare is refused (there is nothing to restore into). A transformers Trainer
is ckpt.integrations.hf_trainer's: its LR scheduler and its own state are not the
accelerator's.
"""

from __future__ import annotations

import os
from typing import Any

import ckpt
from ckptd.format import checkpoint as ckfmt
from ckptd.storage import JobLocation, open_storage

__all__ = ["accelerator_state", "load_state", "save_state"]


def accelerator_state(accelerator: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state ckpt saves for an Accelerator: objects restored in place by load_state."""
    state: dict[str, Any] = {
        "models": [accelerator.unwrap_model(m) for m in accelerator._models],
        "optimizers": list(accelerator._optimizers),
        "schedulers": list(accelerator._schedulers),
        "custom": list(accelerator._custom_objects),
        "rng": ckpt.PerRank(ckpt.RNGState()),
    }
    if extra is not None:
        state["extra"] = extra
    return state


def save_state(
    accelerator: Any,
    path: str | os.PathLike[str],
    step: int,
    *,
    extra: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Any:
    """Save the Accelerator's training state as step `step` of the ckptd job at `path`.

    extra: more state (tensors and plain values) saved beside it, e.g. {"epoch": 3}.
    Returns ckpt.save's SaveResult once the step is committed.
    """
    state = accelerator_state(accelerator, extra)
    return ckpt.save(state, path, step=step, metadata=metadata, keep_last=keep_last)


def load_state(
    accelerator: Any,
    path: str | os.PathLike[str],
    step: int | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> int | None:
    """Restore the newest committed step (or `step`) into the Accelerator's objects.

    Returns the step loaded, or None when `path` holds no checkpoint yet (a new run).
    extra: a dict filled in place with what save_state's extra held.
    """
    loc = JobLocation.of(path)
    if not (accelerator._models or accelerator._optimizers or accelerator._custom_objects):
        # Nothing to restore into: a step "loaded" here would be a silent fresh start.
        raise ValueError(
            f"load_state({str(path)!r}): the Accelerator has no prepared model, optimizer or "
            "registered object yet; call it after accelerator.prepare(...) (with a "
            "transformers Trainer, use ckpt.integrations.hf_trainer.CkptdTrainer)"
        )
    if step is None and (loc.is_url or os.path.isdir(loc.path)):
        if not ckfmt.list_steps(open_storage(loc)):
            return None
    elif step is None:
        return None
    result = ckpt.load(accelerator_state(accelerator, extra), path, step=step)
    return int(result.step)
