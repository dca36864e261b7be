"""A save's stall says how much of it was Python's garbage collector (SaveResult.gc_s): a
full collection walks every container object of the process (90-160 ms with torch
imported, on the bench's VM) and runs in whatever allocates when one falls due, a save's
flatten sometimes; the save's log line then says so too (ckpt._gcclock)."""

from __future__ import annotations

import gc
import threading
from typing import Any

import torch

import ckpt
from ckpt._gcclock import GcClock


class CollectsWhenSaved:
    """A stateful object whose state_dict() (called by the save's flatten, inside the
    stall) runs a full collection, as one falling due there would."""

    def __init__(self) -> None:
        self.saved = 0

    def state_dict(self) -> dict[str, Any]:
        gc.collect()
        self.saved += 1
        return {"saved": self.saved}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.saved = sd["saved"]


def test_a_collection_in_the_stall_is_reported_with_the_save(job, caplog):
    state = {"w": torch.randn(1 << 16), "collects": CollectsWhenSaved()}
    with ckpt.Checkpointer(job, verify="size") as cp:
        with caplog.at_level("INFO", logger="ckpt"):
            result = cp.save(state, 1).wait()
    assert state["collects"].saved == 1
    assert 0 < result.gc_s <= result.blocking_s
    assert f"{result.gc_s:.3f} s of it in Python's garbage collector" in caplog.text


def test_a_stall_without_a_collection_reports_none(job, caplog):
    state = {"w": torch.randn(1 << 16)}
    enabled = gc.isenabled()
    gc.disable()  # no collection can fall due inside this save
    try:
        with ckpt.Checkpointer(job, verify="size") as cp:
            with caplog.at_level("INFO", logger="ckpt"):
                result = cp.save(state, 1).wait()
    finally:
        if enabled:
            gc.enable()
    assert result.gc_s == 0.0
    assert "committed" in caplog.text and "garbage collector" not in caplog.text


def test_the_clock_counts_other_threads_collections_and_only_inside_its_block():
    with GcClock() as clock:
        t = threading.Thread(target=gc.collect)  # holds the GIL: the caller waited too
        t.start()
        t.join()
    assert clock.s > 0
    assert clock._tick not in gc.callbacks
    inside = clock.s
    gc.collect()
    assert clock.s == inside
