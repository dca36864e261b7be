"""One rank of a job that saves with the module-level `ckpt.save(state, path, step=...)`.

The state is replicated (DDP-style): every chunk is held by every rank and must reach
storage once. Writes the bytes its shard file holds on disk (allocated blocks) and what its
index lists to <out>/rank<r>.json.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback


def main(rank: int, world: int, port: int, job: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    result: dict = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist

        import ckpt

        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        g = torch.Generator().manual_seed(0)  # the same values on every rank: replicas
        state = {f"layer{i}": torch.randn(256, 1024, generator=g) for i in range(8)}  # 8 MiB
        res = ckpt.save(state, job, step=1)
        manifest = json.load(open(os.path.join(res.path, "MANIFEST.json")))
        [mine] = [s for s in manifest["shards"] if s["rank"] == rank]
        st = os.stat(os.path.join(res.path, mine["path"]))
        index = json.load(open(os.path.join(res.path, mine["index"])))
        result.update(
            allocated=st.st_blocks * 512,
            size=st.st_size,
            indexed=sum(e["length"] for e in index["entries"]),
            state_bytes=sum(t.nbytes for t in state.values()),
        )
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported through the result file
        result["error"] = traceback.format_exc()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
