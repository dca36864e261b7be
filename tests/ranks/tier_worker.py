"""One rank of a 2-rank gloo job with a mirror tier: save (phase "save"), resume (phase
"resume"), or resume past a damaged step and save it again (phase "resave"), and write
what it saw to OUT_DIR/rank<r>.json.

Each rank saves its own tensor (ckpt.PerRank: each rank's shard holds different bytes)
plus a replicated one; resume checks its tensors bit-exactly against the saved values.
While saving, each rank's mirror uploader reads the local tier through `OwnFilesOnly`:
another rank's shard or index is refused, as on a node's own disk.
Run as a multiprocessing (spawn) target: `spawn_entry(rank, world, port, phase, job,
mirror, out_dir)`.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def own_files_only(inner, rank: int):  # noqa: ANN001, ANN201
    """The local tier as one node sees it: other ranks' shard files are not there."""
    from ckpt_testutil import DelegatingStorage

    from ckptd.errors import ShardMissing
    from ckptd.format import layout

    mine = layout.shard_name(rank).rsplit("/", 1)[-1].rsplit(".", 1)[0] + "."  # rank-00001.

    class OwnFilesOnly(DelegatingStorage):
        def _check(self, path: str) -> None:
            name = path.rsplit("/", 1)[-1]
            if name.startswith("rank-") and not name.startswith(mine):
                raise ShardMissing(f"rank {rank} cannot see {path} (another node's disk)")

        def open_read(self, path, *, cold=False):  # noqa: ANN001, ANN201
            self._check(path)
            return super().open_read(path, cold=cold)

        def read_bytes(self, path, *, limit):  # noqa: ANN001, ANN201
            self._check(path)
            return super().read_bytes(path, limit=limit)

        def size(self, path):  # noqa: ANN001, ANN201
            self._check(path)
            return super().size(path)

        def local_path(self, path):  # noqa: ANN001, ANN201
            self._check(path)
            return super().local_path(path)

    return OwnFilesOnly(inner)


def state(rank: int, step: int, fresh: bool):  # noqa: ANN201
    import torch

    import ckpt

    g = torch.Generator().manual_seed(1000 * step + rank)
    own = torch.randn(5000, generator=g)
    rep = torch.arange(300, dtype=torch.float32) * step
    if fresh:
        own, rep = torch.zeros_like(own), torch.zeros_like(rep)
    return {"own": ckpt.PerRank(own), "rep": rep}


def _run(rank: int, world: int, phase: str, job: str, mirror: str, out_dir: str) -> int:
    import torch
    import torch.distributed as dist

    import ckpt

    result: dict = {"rank": rank, "error": None}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        with ckpt.Checkpointer(job, mirror=mirror) as cp:
            if phase == "save":
                assert cp._mirror is not None
                cp._mirror.source = own_files_only(cp._mirror.source, rank)
                for step in (1, 2):
                    cp.save(state(rank, step, False), step, blocking=True)
                    if cp._mirror is not None:
                        assert cp._mirror.wait(60)
                        result["mirror_failures"] = dict(cp._mirror.failures)
            elif phase == "resave":
                # Step 2 is damaged in both tiers: resume falls back to 1, then step 2 is
                # saved again, over the quarantined copies in both tiers.
                assert cp._mirror is not None
                cp._mirror.source = own_files_only(cp._mirror.source, rank)
                result["step"] = cp.resume(state(rank, 0, True))
                cp.save(state(rank, 2, False), 2, blocking=True)
                assert cp._mirror.wait(60)
                result["mirror_failures"] = dict(cp._mirror.failures)
            else:
                st = state(rank, 0, True)
                result["step"] = cp.resume(st)
                want = state(rank, 2, False)
                result["exact"] = torch.equal(st["own"].value, want["own"].value) and (
                    torch.equal(st["rep"], want["rep"])
                )
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    return 0 if result["error"] is None else 1


def spawn_entry(
    rank: int, world: int, port: int, phase: str, job: str, mirror: str, out_dir: str
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    log = os.open(
        os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
    )
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    code = _run(rank, world, phase, job, mirror, out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)
