"""A rank of a 2-node x 2-rank job on this host (tests/test_nodes.py): gloo, LOCAL_RANK env.

Saves step 1 (every rank commits), then step 2 with CKPT_CRASH_AT picking a rank to die
mid-write; writes what it saw to <out>/rank<r>.json."""

from __future__ import annotations

import json
import os
import sys
import time


def entry(rank: int, world: int, per_node: int, port: int, job: str, out: str, crash: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fd = os.open(os.path.join(out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),
    )
    import torch
    import torch.distributed as dist

    import ckpt

    dist.init_process_group("gloo", rank=rank, world_size=world)
    res: dict = {"rank": rank}
    ck = ckpt.Checkpointer(job, lease_s=3.0, timeout_s=60)
    conn = ck._conn
    res["via_aggregator"] = conn.save_client is not conn.client
    res["hosts_aggregator"] = conn.aggregator is not None
    state = {"w": ckpt.PerRank(torch.full((64,), float(rank))), "shared": torch.arange(16.0)}
    ck.save(state, 1)
    ck.wait()
    res["step1"] = "COMMITTED"
    if not crash:  # the same layout again: cached plans, through the aggregator
        for step in (2, 3):
            ck.save(
                {
                    "w": ckpt.PerRank(torch.full((64,), float(step + rank))),
                    "shared": state["shared"],
                },
                step,
            )
            ck.wait()
        res["steps_2_3"] = "COMMITTED"
        dist.barrier()  # rank 0 hosts the coordinator: it stays until every rank is done
        res["layout_known"] = bool(conn.save_client is not None and conn.save_client.layouts)
        if conn.aggregator is not None:  # what went by the node session, what by unary
            res["session_calls"] = conn.aggregator.session.calls_sent
            res["session_fell_back"] = conn.aggregator.session.fell_back
    if crash:
        os.environ["CKPT_CRASH_AT"] = crash
        t0 = time.monotonic()
        try:
            ck.save(
                {"w": ckpt.PerRank(torch.full((4096,), 2.0 + rank)), "shared": torch.arange(16.0)},
                2,
            )
            ck.wait()
            res["step2"] = "COMMITTED"
        except Exception as e:  # the save of a dead peer's step must fail, saying why
            res["step2"] = f"{type(e).__name__}: {e}"
        res["step2_s"] = time.monotonic() - t0
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    os._exit(0)  # the dead peer leaves the process group unusable for a clean shutdown
