"""Peak RSS of a rank during an s3:// save of one large shard; save and load rates
against a bare s3fs put and get of the same bytes in the same run.

Starts moto's S3 server on 127.0.0.1 in this process (it keeps every object in its own
memory), then runs each save in a child process of its own, the rank, whose memory is the
figure: the child builds a random fp32 state of `--size-mib`, resets its peak RSS
(/proc/self/clear_refs, 5), runs `ckpt.save(state, "s3://...", verify="size")` and
reports VmHWM (peak resident set since the reset) and VmRSS before the save. So
"peak - before" is what the save itself held on top of the state: the staging image, the
upload buffers, botocore's. GB/s is the shard's bytes (as counted where they reached the
store, ckptd.storage.counters) over the save's wall time. The child then loads the step
(`ckpt.load`, every block verified; bytes as counted) and, as the floors, puts the same
bytes with a bare s3fs `pipe_file` (ckptd's part size and concurrency) and gets them back
with `cat_file`, against the same server: "save/put" and "load/get" are the ratios.

`--trees` names source trees to compare (each child runs with PYTHONPATH on that tree),
interleaved per repetition against the same server; by default the tree this script
lives in:

    .venv/bin/python bench/s3_save_rss.py --trees /work/base14,.   # before, after
    .venv/bin/python bench/s3_save_rss.py --size-mib 256 --reps 1   # quick

GB = 1e9 bytes. moto is a Python server on the same machine, so the absolute GB/s say
little about a real object store; the RSS is the point.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import uuid

MiB = 1 << 20
GB = 1e9
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(url: str, size_mib: int) -> None:
    import torch

    import ckpt
    from ckptd.storage import counters

    state = {"w": torch.randn(size_mib * MiB // 4, generator=torch.Generator().manual_seed(0))}
    # Warm the imports and the s3 client on a tiny save, so that the figure is the save's.
    ckpt.save({"x": torch.arange(4.0)}, url + "-warm", step=1)
    before_rss = _status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    c0 = counters.snapshot()
    t = time.perf_counter()
    ckpt.save(state, url, step=1, verify="size")
    dt = time.perf_counter() - t
    peak_kib = _status_kib("VmHWM")  # the save's peak, before the load and the floors
    wrote = counters.snapshot() - c0
    c1 = counters.snapshot()
    t = time.perf_counter()
    ckpt.load({}, url, step=1)
    load_s = time.perf_counter() - t
    read = counters.snapshot() - c1
    put_s, get_s, raw_n = _bare_s3fs(url, state["w"])
    out = {
        "load_seconds": load_s,
        "read_bytes": read.read_bytes,
        "put_seconds": put_s,
        "get_seconds": get_s,
        "raw_bytes": raw_n,
        "before_mib": before_rss / 1024,
        "peak_mib": peak_kib / 1024,
        "hwm_reset": reset,
        "seconds": dt,
        "written_bytes": wrote.written_bytes,
        "write_calls": wrote.write_calls,
    }
    print(json.dumps(out), flush=True)


def _bare_s3fs(url: str, w: object) -> tuple[float, float, int]:
    """The floor: the tensor's bytes put and got back by s3fs alone (seconds, bytes)."""
    import s3fs

    from ckptd import knobs

    raw = w.numpy().tobytes()  # type: ignore[attr-defined]
    fs = s3fs.S3FileSystem()
    key = url.removeprefix("s3://") + "-bare/raw.bin"
    k = knobs.get()
    try:
        from ckptd.storage.object_writes import part_size

        chunk = part_size(len(raw), k)
    except ImportError:  # a tree from before streaming uploads: ckptd's parts of today
        chunk = 32 << 20
    t = time.perf_counter()
    fs.pipe_file(key, raw, chunksize=chunk, max_concurrency=getattr(k, "upload_concurrency", 8))
    put_s = time.perf_counter() - t
    t = time.perf_counter()
    got = fs.cat_file(key)
    get_s = time.perf_counter() - t
    assert len(got) == len(raw)
    return put_s, get_s, len(raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--trees", default=HERE, help="comma-separated source trees")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.size_mib)
        return

    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    os.environ.update(env)  # for this process's client as well as the children
    import boto3

    s3 = boto3.client("s3")
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    failed: dict[str, list[str]] = {t: [] for t in trees}
    for _ in range(args.reps):
        for tree in trees:
            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            s3.create_bucket(Bucket=bucket)
            r = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", f"s3://{bucket}/job"]
                + ["--size-mib", str(args.size_mib)],
                env={**env, "PYTHONPATH": f"{tree}:{tree}/clients/python"},
                capture_output=True,
                text=True,
                check=False,
            )
            if r.returncode != 0:
                # A failed save is a figure too (moto answers 500s under memory pressure):
                # counted, its cause printed, the run goes on.
                failed[tree].append(r.stderr.strip().splitlines()[-1][-300:])
            else:
                runs[tree].append(json.loads(r.stdout.strip().splitlines()[-1]))
            # Free moto's copy before the next run (it holds every object in memory).
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                for o in page.get("Contents", []):
                    s3.delete_object(Bucket=bucket, Key=o["Key"])
    server.stop()

    print(
        f"s3:// save of one {args.size_mib} MiB shard (fp32 state, verify=size), moto on "
        f"localhost, {args.reps} reps, median (min-max)"
    )
    print(
        f"  {'tree':28s} {'RSS before':>10s} {'peak RSS':>17s} {'save held':>17s} "
        f"{'save GB/s':>14s} {'s3fs put':>14s} {'save/put':>8s} {'load GB/s':>14s} "
        f"{'s3fs get':>14s} {'load/get':>8s}"
    )
    for tree, rs in runs.items():
        for why in failed[tree]:
            print(f"  {tree[-28:]:28s} FAILED: {why}")
        if not rs:
            continue
        peak = [r["peak_mib"] for r in rs]
        held = [r["peak_mib"] - r["before_mib"] for r in rs]
        gbs = [r["written_bytes"] / GB / r["seconds"] for r in rs]
        put = [r["raw_bytes"] / GB / r["put_seconds"] for r in rs]
        load = [r["read_bytes"] / GB / r["load_seconds"] for r in rs]
        get = [r["raw_bytes"] / GB / r["get_seconds"] for r in rs]

        def cell(v: list[float], fmt: str) -> str:
            return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"

        print(
            f"  {tree[-28:]:28s} {statistics.median([r['before_mib'] for r in rs]):7.0f} MiB"
            f" {cell(peak, '.0f'):>17s} {cell(held, '.0f'):>17s} {cell(gbs, '.3f'):>14s}"
            f" {cell(put, '.3f'):>14s} {statistics.median(gbs) / statistics.median(put):8.2f}"
            f" {cell(load, '.3f'):>14s} {cell(get, '.3f'):>14s}"
            f" {statistics.median(load) / statistics.median(get):8.2f}"
        )
        if not all(r["hwm_reset"] for r in rs):
            print("    (peak RSS not reset before the save: it includes start-up)")


if __name__ == "__main__":
    main()
