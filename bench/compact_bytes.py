"""Bytes a save writes, divided by the state's size: 1, 2 and 4 ranks, local and s3://.

Each configuration starts WORLD real ranks (multiprocessing spawn, gloo on CPU) that save
one state through a zero-config Checkpointer and report what their storage counters
(`ckptd.storage.counters`, counted at each backend's pwrite / PUT) saw written for the
shard data; the figure is the sum over the ranks divided by the state's (global) bytes,
next to the shards' total size in the manifest (what a copy or a mirror moves). The goal
(issue 14) is at most 1.02 plus alignment. States (--mib in total, 8 fp32 tensors):

  replicated   every tensor held by every rank (DDP)
  half         half the bytes replicated, half DTensors sharded by rows (Shard(0))

s3:// runs against moto's ThreadedMotoServer on 127.0.0.1 (tests/s3_server.py's
server; skipped when moto or s3fs is missing). Every load is checked bit-exactly after
the save (untimed; load-side bytes are not measured here). To compare with another
checkout, run this script with that checkout on PYTHONPATH:

    PYTHONPATH=.:clients/python .venv/bin/python bench/compact_bytes.py [--mib 64]
    PYTHONPATH=/other:/other/clients/python .venv/bin/python bench/compact_bytes.py

Writes bench/results/compact_bytes-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import _common as C

N_TENSORS = 8
TESTS = Path(__file__).resolve().parent.parent / "tests"


def make_state(world: int, kind: str, mib: int, fresh: bool) -> tuple[dict[str, Any], int]:
    import torch

    mesh = None
    if kind == "half":  # DTensors need the process group
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    rows = mib * (1 << 20) // N_TENSORS // 4 // 256
    g = torch.Generator().manual_seed(5)
    state: dict[str, Any] = {}
    for i in range(N_TENSORS):
        t = torch.randn(rows, 256, generator=g)
        if fresh:
            t = torch.zeros_like(t)
        if mesh is not None and i % 2:
            from torch.distributed.tensor import Shard, distribute_tensor

            state[f"sharded{i}"] = distribute_tensor(t, mesh, [Shard(0)])
        else:
            state[f"replicated{i}"] = t
    return state, rows * 256 * 4 * N_TENSORS


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def rank_main(rank: int, world: int, port: int, job: str, kind: str, mib: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    import ckpt
    from ckptd.storage import counters

    res: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        state, res["state_bytes"] = make_state(world, kind, mib, fresh=False)
        with ckpt.Checkpointer(job, timeout_s=120) as cp:
            before = counters.snapshot()
            cp.save(state, 1).wait()
            res["written"] = (counters.snapshot() - before).written_bytes
            fresh, _ = make_state(world, kind, mib, fresh=True)
            cp.load(fresh, 1)
        res["exact"] = all(torch.equal(_local(fresh[k]), _local(state[k])) for k in state)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        res["error"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shard_sizes(job: str) -> int:
    """The shards' total size as the committed manifest records it."""
    from ckptd.format import checkpoint as ckfmt
    from ckptd.storage import open_storage

    return sum(s.size for s in ckfmt.read_manifest(open_storage(job), 1).shards)


def run_one(world: int, kind: str, mib: int, job: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [
            ctx.Process(target=rank_main, args=(r, world, port, job, kind, mib, out))
            for r in range(world)
        ]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
            if p.is_alive():
                p.kill()
        res = []
        for r in range(world):
            f = Path(out, f"rank{r}.json")
            res.append(json.loads(f.read_text()) if f.exists() else {"error": "no result"})
    for r in res:
        if r.get("error") or not r.get("exact"):
            raise RuntimeError(f"{world} ranks {kind}: {r.get('error') or 'load not exact'}")
    state = res[0]["state_bytes"]
    written = sum(r["written"] for r in res)
    shards = shard_sizes(job)
    return {
        "world": world,
        "kind": kind,
        "state_bytes": state,
        "written_bytes": written,
        "shard_bytes": shards,
        "written_x": written / state,
        "shards_x": shards / state,
        "seconds": time.perf_counter() - t0,
    }


def start_s3() -> tuple[Any, Any] | None:
    try:
        import s3fs  # noqa: F401
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    except ImportError as e:
        print(f"s3:// skipped: {e}")
        return None
    sys.path.insert(0, str(TESTS))
    from s3_server import S3Server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(f"http://{host}:{port}")
    os.environ.update(s3.env())  # the ranks inherit the endpoint and the fake credentials
    return server, s3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="the state's total size (MiB)")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--backends", default="local,s3")
    args = ap.parse_args(argv)
    import ckptd

    print(f"ckptd from {Path(ckptd.__file__).parent}")
    rows: list[dict[str, Any]] = []
    s3 = start_s3() if "s3" in args.backends else None
    try:
        C.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=C.RESULTS_DIR) as work:
            n = 0
            for backend in args.backends.split(","):
                if backend == "s3" and s3 is None:
                    continue
                for kind in ("replicated", "half"):
                    for world in (int(w) for w in args.worlds.split(",")):
                        n += 1
                        if backend == "s3":
                            job = f"s3://{s3[1].new_bucket()}/job{n}"  # type: ignore[index]
                        else:
                            job = f"{work}/job{n}"
                        row = {"backend": backend, **run_one(world, kind, args.mib, job)}
                        rows.append(row)
                        print(
                            f"{backend:6} {kind:10} {world} ranks: written {row['written_x']:.3f}x"
                            f"  shards {row['shards_x']:.3f}x  ({row['seconds']:.1f} s)",
                            flush=True,
                        )
    finally:
        if s3 is not None:
            s3[0].stop()
    print("\n| backend | state | ranks | written / state | shard files / state |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['kind']} | {r['world']} | {r['written_x']:.3f} "
            f"| {r['shards_x']:.3f} |"
        )
    path = C.write_results(
        "compact_bytes",
        {"machine": C.machine_info(Path(tempfile.gettempdir())), "mib": args.mib, "rows": rows},
    )
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
