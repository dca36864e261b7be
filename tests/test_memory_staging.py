"""One rank's staging image is shared by its memory and persistent saves (ckpt._memory):
a memory save stages into the Checkpointer's image unless a persistent save is being
written out of it, and a persistent save stages into an image of its own while a memory
save still writes out of the shared one. Real agent process, real files; each step must
load back exactly the state it saved, so a save that staged over bytes another save was
still writing fails here."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import _memory


@pytest.fixture
def tier(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("CKPTD_AGENT_HOST", "127.0.0.1")
    root = tmp_path / "shm"
    yield ckpt.MemoryTier(every=1, root=str(root), node=0, nodes=1, replicas=0, max_steps=4)
    try:
        pid = int(json.loads((root / "agent.json").read_text())["pid"])
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        return
    # The save started it from this process and keeps its Popen (the agent is meant to
    # outlive the rank): wait on that, or the Popen, collected at exit with no exit status,
    # is the "subprocess N is still running" ResourceWarning at the end of a test run.
    for proc in _memory._STARTED:
        if proc.pid == pid:
            proc.wait(10)


def state_at(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(16 << 20, dtype=torch.float32) * 1e-3 + step}  # 64 MiB


def test_memory_and_persistent_saves_share_one_staging_image(tmp_path, tier):
    with ckpt.Checkpointer(str(tmp_path / "job"), memory=tier) as cp:
        saver = cp._memory
        assert saver is not None
        state = state_at(1)
        cp.save_memory(state, 1).wait()
        # No persistent save in flight: the memory save staged into the Checkpointer's
        # image, and the saver mapped none of its own.
        assert cp._image.capacity >= 64 << 20 and saver._spare.capacity == 0
        # A persistent save in flight: the memory save stages into the spare.
        state = state_at(2)
        persistent = cp.save(state, 2)
        state = state_at(3)
        mem = cp.save_memory(state, 3)
        assert saver._staged_in is saver._spare or persistent.done()
        # A memory save still writing out of the shared image: the persistent save
        # stages into one of its own (the memory save hashes 64 MiB before it writes).
        mem.wait()
        persistent.wait()
        state, after = state_at(4), state_at(5)  # made before: making one takes a while
        mem = cp.save_memory(state, 4)
        assert saver.holds_shared
        state = after
        persistent = cp.save(state, 5)
        state["w"].add_(1.0)  # training goes on over the tensors the saves staged
        mem.wait()
        persistent.wait()
        assert saver._spare.capacity == 0 and not saver.holds_shared  # unmapped, handed back
        for step in (1, 2, 3, 4, 5):
            got = {"w": torch.zeros(16 << 20)}
            res = cp.load(got, step=step)
            assert torch.equal(got["w"], state_at(step)["w"]), (step, res.tier)
        assert cp.load({"w": torch.zeros(16 << 20)}, step=4).tier == "memory"


def test_a_persistent_save_releases_the_image_of_its_own_after_writing(tmp_path, tier, monkeypatch):
    # The one-off image a persistent save stages into (a memory save holds the shared one)
    # is unmapped, and on CUDA unregistered, when the save is written: left to the garbage
    # collector it would stay mapped (and pinned) for as long as the SaveJob lives.
    import ckpt._checkpointer as checkpointer
    from ckpt._staging import HostImage

    made: list[HostImage] = []

    class Recorded(HostImage):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(checkpointer, "HostImage", Recorded)
    with ckpt.Checkpointer(str(tmp_path / "job"), memory=tier) as cp:
        saver = cp._memory
        assert saver is not None
        state, after = state_at(1), state_at(2)
        mem = cp.save_memory(state, 1)
        assert saver.holds_shared
        persistent = cp.save(after, 2)
        own = [image for image in made if image is not cp._image]
        assert len(own) == 1 and own[0].capacity >= 64 << 20  # staged into it
        persistent.wait()
        assert own[0].capacity == 0  # released once written
        mem.wait()
        got = {"w": torch.zeros(16 << 20)}
        cp.load(got, step=2)
        assert torch.equal(got["w"], state_at(2)["w"])
