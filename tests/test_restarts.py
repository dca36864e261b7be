"""Restarts under torchrun: a new attempt finds the new coordinator, not the previous one.

torchrun keeps one key-value store across restarts of the workers, so a key the previous
attempt wrote is still there when the next attempt starts. Two real gloo ranks play both
attempts in one process group (TORCHELASTIC_RUN_ID / TORCHELASTIC_RESTART_COUNT as
torchrun sets them); in the second, rank 0 is slow to start its coordinator, and rank 1
must wait for it instead of taking the address the first attempt left in the store.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from coordinator_fixtures import child_env, free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

RANK = """
import json, os, sys, time, datetime
import torch, torch.distributed as dist
import ckpt

job, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
os.environ["TORCHELASTIC_RUN_ID"] = "run-1"
seen = []
for restart in (0, 1):
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart)
    if restart == 1 and rank == 0:
        time.sleep(1.0)  # rank 1 asks for the coordinator before this one exists
    with ckpt.Checkpointer(job, timeout_s=30) as cp:
        cp.resume({"w": torch.zeros(4), "step": 0})
        cp.save({"w": torch.ones(4) * restart, "step": restart + 1}, restart + 1).wait()
        seen.append([cp.attempt, cp.generation, cp.address])
    dist.barrier()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)
"""


def test_a_restarted_attempt_does_not_use_the_previous_attempts_coordinator(
    tmp_path: Path,
) -> None:
    job, out = tmp_path / "job", tmp_path / "out"
    out.mkdir()
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(job), str(out)],
            env=child_env(
                RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        results = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            p.kill()
    logs = "\n".join(f"--- rank {r}\n{o}\n{e}" for r, (o, e) in enumerate(results))
    assert [p.returncode for p in procs] == [0, 0], logs
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0] == seen[1], logs  # both ranks: the same attempt, generation, coordinator
    (a0, g0, addr0), (a1, g1, addr1) = seen[0]
    assert (a0, g0) == ("run-1/0", 0) and (a1, g1) == ("run-1/1", 1)
    assert addr0 != addr1


NODE_RESTARTED = """
import datetime, json, os, sys
import torch, torch.distributed as dist
import ckpt

job, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
seen = []
with ckpt.Checkpointer(job, timeout_s=20) as cp:
    cp.resume({"w": torch.zeros(4), "step": 0})
    cp.save({"w": torch.ones(4), "step": 1}, 1).wait()
    seen.append([cp.attempt, cp.generation, cp.address])
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)
"""


def test_a_node_started_again_names_the_launch_as_rank_0_does(tmp_path: Path) -> None:
    """torchrun with a store per round: the ranks' restart counts differ, one attempt all the same.

    Host A's agent counted one restart, host B's agent is new (counts from 0): the name
    is rank 0's, taken from this round's own store, and it is not the count's (a restart
    because a node joined is not counted: the count would name two launches alike).
    """
    job, out = tmp_path / "job", tmp_path / "out"
    out.mkdir()
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", NODE_RESTARTED, str(job), str(out)],
            env=child_env(
                RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="1",  # one rank per node: rank 0 listens on all interfaces
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TORCHELASTIC_RUN_ID="run-2",
                TORCHELASTIC_RESTART_COUNT=str(1 - r),
                TORCHELASTIC_USE_AGENT_STORE="False",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        results = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            p.kill()
    logs = "\n".join(f"--- rank {r}\n{o}\n{e[-3000:]}" for r, (o, e) in enumerate(results))
    assert [p.returncode for p in procs] == [0, 0], logs
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0] == seen[1], logs
    ((attempt, generation, _),) = seen[0]
    assert generation == 0 and attempt not in ("run-2/0", "run-2/1"), seen
