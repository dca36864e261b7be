"""One rank of a torchrun job that saves through the zero-config coordinator while the test
scrapes that coordinator's metrics ($CKPTD_METRICS_PORT on the hosting rank).

    python -m torch.distributed.run --standalone --nproc-per-node 2 metrics_worker.py JOB GO

Every rank saves its half of a tensor at steps 1 and 2, then waits (at a barrier) until the
file GO exists (the test has scraped), then saves step 3 and exits.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import ckpt


def main(job: str, go: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    w = torch.arange(4096, dtype=torch.float32) + rank
    with ckpt.Checkpointer(job) as cp:
        for step in (1, 2):
            cp.save({"w": ckpt.PerRank(w + step)}, step).wait()
        if rank == 0:
            while not os.path.exists(go):  # the test scrapes meanwhile
                time.sleep(0.05)
        dist.barrier()
        cp.save({"w": ckpt.PerRank(w + 3)}, 3).wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
