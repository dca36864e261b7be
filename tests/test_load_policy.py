"""The load policy is one rule for one tier or several, one rank or many (ckpt._load).

Before it, a job with a mirror and one without loaded through two copies of the policy
that disagreed: the same damage gave different results, a load by explicit step
quarantined only with a mirror, a raw I/O error was fatal only without one, a load by
explicit step with a mirror needed every rank, and a rank's quarantine marker was
overruled by its peers' view. Each test here shows one of those with real files (and a
real 2-rank gloo process group where the rule is about ranks).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from ckpt_testutil import DelegatingStorage, flip_bit, shard_path
from coordinator_fixtures import spawn_ranks
from ranks import load_worker

import ckpt
from ckptd.errors import StorageError
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.storage import open_storage

pytestmark = pytest.mark.timeout(120)

MEM = fsspec.filesystem("memory")


def state_for(step: int) -> dict[str, Any]:
    return {"w": torch.full((300,), float(step))}


def save_steps(cp: ckpt.Checkpointer, *steps: int) -> None:
    for s in steps:
        cp.save(state_for(s), s, blocking=True)
        if cp._mirror is not None:
            assert cp._mirror.wait(60)


def damage_local(job: str, step: int) -> None:
    flip_bit(shard_path(job, step), 70)


def damage_mirror(mirror: str, step: int) -> None:
    p = f"/{mirror[len('memory://') :]}/{layout.step_dir(step)}/{layout.shard_name(0)}"
    data = bytearray(MEM.cat_file(p))
    data[70] ^= 1
    MEM.pipe_file(p, bytes(data))


def test_the_same_damage_gives_the_same_result_with_and_without_a_mirror(
    tmp_path: Path, mem_mirror: str
) -> None:
    plain, mirrored = str(tmp_path / "plain"), str(tmp_path / "mirrored")
    with ckpt.Checkpointer(plain) as cp:
        save_steps(cp, 1, 2)
    with ckpt.Checkpointer(mirrored, mirror=mem_mirror) as cp:
        save_steps(cp, 1, 2)
    damage_local(plain, 2)
    damage_local(mirrored, 2)
    damage_mirror(mem_mirror, 2)  # every copy of step 2 is bad
    results = []
    for job, mirror in ((plain, None), (mirrored, mem_mirror)):
        with ckpt.Checkpointer(job, mirror=mirror) as cp:
            res = cp.load({})
        assert torch.equal(res.state["w"], state_for(1)["w"])
        results.append((res.step, res.fell_back_from, res.quarantined))
        assert res.fallback_reason is not None and "rank-00000.bin" in res.fallback_reason
    assert results == [(1, 2, [2]), (1, 2, [2])]
    assert ckfmt.quarantine_reason(open_storage(mem_mirror), 2) is not None


def test_a_load_by_explicit_step_marks_nothing_in_any_tier(tmp_path: Path, mem_mirror: str) -> None:
    plain, mirrored = str(tmp_path / "plain"), str(tmp_path / "mirrored")
    with ckpt.Checkpointer(plain) as cp:
        save_steps(cp, 1, 2)
    with ckpt.Checkpointer(mirrored, mirror=mem_mirror) as cp:
        save_steps(cp, 1, 2)
    damage_local(plain, 2)
    damage_local(mirrored, 2)
    with ckpt.Checkpointer(plain) as cp:
        with pytest.raises(ckpt.HashMismatch):
            cp.load({}, step=2)
    with ckpt.Checkpointer(mirrored, mirror=mem_mirror) as cp:
        res = cp.load({}, step=2)  # the mirror's copy, after the local one failed
        assert res.step == 2 and torch.equal(res.state["w"], state_for(2)["w"])
        assert "local tier" in (res.fallback_reason or "")
    # Neither explicit load quarantined the copy it found damaged ...
    assert ckfmt.quarantine_reason(open_storage(plain), 2) is None
    assert ckfmt.quarantine_reason(open_storage(mirrored), 2) is None
    # ... a load that chooses its step does, in both jobs, and says so in the same way.
    with ckpt.Checkpointer(plain) as cp:
        res = cp.load({})
        assert (res.step, res.fell_back_from, res.quarantined) == (1, 2, [2])
    with ckpt.Checkpointer(mirrored, mirror=mem_mirror) as cp:
        res = cp.load({})  # the same step from the mirror: no step was fallen back from
        assert (res.step, res.fell_back_from, res.quarantined) == (2, None, [2])
    assert ckfmt.quarantine_reason(open_storage(plain), 2) is not None
    assert ckfmt.quarantine_reason(open_storage(mirrored), 2) is not None
    assert ckfmt.quarantine_reason(open_storage(mem_mirror), 2) is None


class _EIOIndex(DelegatingStorage):
    """The device refuses to read step 2's shard index (EIO): unreadable, not damaged."""

    def read_bytes(self, path: str, *, limit: int) -> bytes:
        if path.startswith(layout.step_dir(2)) and path.endswith(".json") and "shards/" in path:
            raise StorageError(errno.EIO, f"read {self.url}/{path} failed: EIO")
        return self.inner.read_bytes(path, limit=limit)


def test_an_unreadable_copy_is_skipped_unmarked_with_or_without_a_mirror(
    job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for s in (1, 2):
        ckpt.save(state_for(s), job, step=s)
    monkeypatch.setattr(ckpt._api, "open_storage", lambda p, **kw: _EIOIndex(open_storage(p)))
    res = ckpt.load({}, job)
    assert (res.step, res.fell_back_from, res.quarantined) == (1, 2, [])
    assert "EIO" in (res.fallback_reason or "")
    monkeypatch.undo()
    assert ckfmt.quarantine_reason(open_storage(job), 2) is None
    assert ckpt.load({}, job).step == 2  # readable again: loaded again


def _spawn(phase: str, job: str, mirror: str, out: Path, timeout: float = 90) -> list[dict]:
    out.mkdir(exist_ok=True)
    _, logs = spawn_ranks(
        load_worker.entry,
        2,
        lambda r, port: (r, 2, port, phase, job, mirror, str(out)),
        out,
        log_name=lambda r: f"{phase}-rank{r}.log",
        timeout=timeout,
    )
    results = [json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in range(2)]
    assert all(r["error"] is None for r in results), logs
    return results


@pytest.mark.multiprocess
def test_a_step_one_rank_sees_quarantined_is_skipped_by_every_rank(tmp_path: Path) -> None:
    """Node-local copies of a job: rank 0's copy has step 2 quarantined (its marker), rank
    1's copy lacks step 3 (not copied yet). The newest step every rank sees committed is 1:
    both load it; no rank reads a step it sees marked bad, and no marker is overruled."""
    src = str(tmp_path / "src")
    for s in (1, 2, 3):
        ckpt.save({"w": torch.full((64,), float(s))}, src, step=s)
    job = tmp_path / "job"
    shutil.copytree(src, job / "copy0")
    shutil.copytree(src, job / "copy1")
    ckfmt.quarantine(open_storage(str(job / "copy0")), 2, "rank 0 found it corrupt earlier")
    shutil.rmtree(job / "copy1" / layout.step_dir(3))
    results = _spawn("own-copy", str(job), "", tmp_path / "out")
    assert [(r["step"], r["w0"], r["fell_back_from"]) for r in results] == [
        (1, 1.0, None),
        (1, 1.0, None),
    ]
    assert ckfmt.quarantine_reason(open_storage(str(job / "copy0")), 2) == (
        "rank 0 found it corrupt earlier"
    )
    assert ckfmt.quarantine_reason(open_storage(str(job / "copy1")), 2) is None


@pytest.mark.multiprocess
def test_a_load_by_explicit_step_with_a_mirror_needs_no_other_rank(tmp_path: Path) -> None:
    """Only rank 0 loads (step=1, e.g. to evaluate an old step): no collective, so it
    returns while rank 1 is busy elsewhere, as without a mirror."""
    job, mirror = str(tmp_path / "job"), str(tmp_path / "mirror")
    with ckpt.Checkpointer(job, mirror=mirror) as cp:
        save_steps(cp, 1, 2)
    results = _spawn("alone", job, mirror, tmp_path / "out")
    assert results[0]["step"] == 1
    assert results[1]["saw_rank0_load"] is True
    assert os.path.exists(tmp_path / "out" / "alone-loaded")
