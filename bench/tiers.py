"""The mirror tier against its limits, in one run: local save, upload, read-back verify.

Starts moto's S3 server on 127.0.0.1 (as the tests do), saves a random state locally
(ckpt.save, verify="full") and straight to s3:// (the same, shard uploaded in parts and
read back), then copies the committed local step to s3:// with
ckptd.format.mirror.mirror_step (bulk put + read back + hash) and compares with the
limits measured in the same run: a bare s3fs `put` of the same shard file and a bare
`cat` (download) of it. moto is a Python server on the same machine, so absolute GB/s say
little about a real object store; the ratios (ckpt's copy vs bare put + cat) are the point.

    .venv/bin/python bench/tiers.py --size-mib 256 --reps 2
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import uuid

import torch

MB = 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        }
    )
    import ckpt
    from ckptd.format import layout
    from ckptd.format.mirror import mirror_step
    from ckptd.storage import open_storage

    n = args.size_mib << 20
    state = {"w": torch.randn(n // 4, generator=torch.Generator().manual_seed(0))}
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        for rep in range(args.reps):
            job = os.path.join(tmp, f"job{rep}")
            t = time.perf_counter()
            ckpt.save(state, job, step=1)
            times.setdefault("local save (verify=full)", []).append(time.perf_counter() - t)
            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            dst = open_storage(f"s3://{bucket}/job")
            dst.fs.mkdir(bucket)
            t = time.perf_counter()
            res = mirror_step(open_storage(job), dst, 1)
            times.setdefault("mirror: whole copy", []).append(time.perf_counter() - t)
            times.setdefault("mirror: upload", []).append(res.upload_s)
            times.setdefault("mirror: read back + verify", []).append(res.verify_s)
            t = time.perf_counter()
            ckpt.save(state, f"s3://{bucket}/direct", step=1)
            times.setdefault("s3 save (verify=full)", []).append(time.perf_counter() - t)
            shard = os.path.join(job, layout.step_dir(1), layout.shard_name(0))
            key = f"{bucket}/raw.bin"
            t = time.perf_counter()
            dst.fs.put(shard, key, chunksize=32 << 20, max_concurrency=8)
            times.setdefault("limit: bare s3fs put", []).append(time.perf_counter() - t)
            t = time.perf_counter()
            dst.fs.cat_file(key)
            times.setdefault("limit: bare s3fs cat", []).append(time.perf_counter() - t)
    server.stop()
    size = n / MB
    print(f"state {size:.0f} MB, {args.reps} reps, median (min-max) MB/s")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"  {k:30s} {size / med[k]:8.0f}  ({size / max(v):.0f}-{size / min(v):.0f})")
    floor = med["limit: bare s3fs put"] + med["limit: bare s3fs cat"]
    print(f"  mirror copy / (bare put + cat):   {med['mirror: whole copy'] / floor:.2f}x time")
    print(
        f"  mirror copy / local save:         {med['mirror: whole copy'] / med['local save (verify=full)']:.2f}x time"
    )


if __name__ == "__main__":
    main()
