"""The one-process save goes through the coordinator like the saves of many ranks.

On main before the change, `ckpt.save(state, job, step=...)` wrote its own manifest and
recorded nothing in the catalog, so a Checkpointer opened on the same job afterwards
warned that the step was "not in the coordinator's catalog; loading it on storage's word
alone": two documented calls that disagreed.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_module_level_save_is_in_the_catalog_a_checkpointer_reads(tmp_path, caplog):
    job = str(tmp_path / "job")
    ckpt.save({"w": torch.arange(6.0)}, job, step=2)
    target = {"w": torch.zeros(6)}
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        with ckpt.Checkpointer(job) as cp:
            res = cp.load(target)
            records = cp.client.list_checkpoints(cp.path)
    assert res.step == 2 and torch.equal(target["w"], torch.arange(6.0))
    assert [(r.step, r.status) for r in records] == [(2, "COMMITTED")]
    assert _warnings(caplog) == []


def test_module_level_saves_and_a_checkpointer_share_one_catalog(tmp_path, caplog):
    """Saves by either call are listed, retained and resumed alike, with no drift warning."""
    job = str(tmp_path / "job")
    ckpt.save({"w": torch.full((3,), 1.0)}, job, step=1)
    with ckpt.Checkpointer(job, keep_last=2) as cp:
        cp.save({"w": torch.full((3,), 2.0)}, 2, blocking=True)
    ckpt.save({"w": torch.full((3,), 3.0)}, job, step=3, keep_last=2)  # retires step 1
    state = {"w": torch.zeros(3)}
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        with ckpt.Checkpointer(job) as cp:
            assert cp.resume(state) == 3
            committed = [r.step for r in cp.client.list_checkpoints(cp.path)]
    assert committed == [2, 3]
    assert torch.equal(state["w"], torch.full((3,), 3.0))
    assert _warnings(caplog) == []


def test_a_failed_module_level_save_can_be_retried_at_the_same_step(tmp_path):
    job = str(tmp_path / "job")
    ckpt.save({"w": torch.ones(2)}, job, step=1)
    with pytest.raises(ckpt.UnsupportedValue, match="bad"):
        ckpt.save({"w": torch.ones(2), "bad": object()}, job, step=2)
    ckpt.save({"w": torch.full((2,), 2.0)}, job, step=2)
    assert ckpt.load({}, job).step == 2


def test_a_job_named_as_its_user_likes_saves_through_either_call(tmp_path):
    """Any one safe directory name, as `ckptd serve` takes it (see test_path_confinement)."""
    job = str(tmp_path / "runs" / "my job ☃ (1)")
    ckpt.save({"w": torch.ones(3)}, job, step=1)
    with ckpt.Checkpointer(job) as cp:
        cp.save({"w": torch.full((3,), 2.0)}, 2, blocking=True)
        assert [r.step for r in cp.client.list_checkpoints(cp.path)] == [1, 2]
    assert torch.equal(ckpt.load({}, job).state["w"], torch.full((3,), 2.0))
    with pytest.raises(ckpt.UnsafePath, match="control character"):
        ckpt.Checkpointer(str(tmp_path / "bad\nname"))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_module_level_saves_of_many_ranks_write_each_replica_once(tmp_path):
    """Several ranks calling ckpt.save(state, path, step) stage as a Checkpointer does, so
    each writes only the chunks assigned to it: a replicated state reaches the disk once
    (promise 7), not once per rank."""
    from coordinator_fixtures import child_env, free_port

    job, out, port = tmp_path / "job", tmp_path / "out", free_port()
    out.mkdir()
    worker = Path(__file__).parent / "ranks" / "module_save_worker.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), "2", str(port), str(job), str(out)],
            env=child_env(),
        )
        for r in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=100) == 0
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert "error" not in res, res["error"]
    state = results[0]["state_bytes"]
    assert sum(r["indexed"] for r in results) == state  # each chunk indexed once
    # What the disk holds: the replicas once (plus block rounding), not 2x the state.
    assert sum(r["allocated"] for r in results) < 1.25 * state, results


def test_a_module_level_save_goes_through_the_processs_open_checkpointer(tmp_path):
    """It neither fences the user's open Checkpointer of the job nor starts another attempt."""
    job = str(tmp_path / "job")
    with ckpt.Checkpointer(job) as cp:
        cp.save({"w": torch.ones(2)}, 1, blocking=True)
        ckpt.save({"w": torch.full((2,), 2.0)}, job, step=2)
        cp.save({"w": torch.full((2,), 3.0)}, 3, blocking=True)  # not StaleGeneration
        gens = {r.step: r.generation for r in cp.client.list_checkpoints(cp.path)}
    assert gens == {1: cp.generation, 2: cp.generation, 3: cp.generation}
    assert torch.equal(ckpt.load({}, job).state["w"], torch.full((2,), 3.0))
