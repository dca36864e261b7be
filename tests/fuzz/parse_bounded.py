"""Manifest and index parsing under a hard memory limit: mutations and bombs.

Run by tests/test_parse_limits.py as a subprocess (the limit is per process):

    python tests/fuzz/parse_bounded.py STEP_DIR --iterations N --as-limit-mib M --bomb-mib B

STEP_DIR is a real committed step (its MANIFEST.json and shards/rank-00000.json are the
seeds). The process caps its address space (RLIMIT_AS) before importing ckptd, then
parses N byte-mutated seeds and a set of bombs of about B MiB each. Every input must parse
or raise a CkptError; a MemoryError or any other exception is a failure. Prints one JSON
document: failures, how each bomb was refused, and the peak RSS (ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
from collections.abc import Callable
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("step_dir")
    p.add_argument("--iterations", type=int, default=500)
    p.add_argument("--as-limit-mib", type=int, default=1024)
    p.add_argument("--bomb-mib", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    limit = args.as_limit_mib << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    from ckptd.errors import CkptError
    from ckptd.format import hashing
    from ckptd.format.manifest import parse_index, parse_manifest

    with open(os.path.join(args.step_dir, "MANIFEST.json"), "rb") as f:
        mbytes = f.read()
    with open(os.path.join(args.step_dir, "shards", "rank-00000.json"), "rb") as f:
        ibytes = f.read()
    m = parse_manifest(mbytes)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10

    def index(data: bytes) -> Any:
        return parse_index(data, manifest=m, shard=m.shards[0], max_entries=1_000_000, what="x")

    failures: list[str] = []
    refused: dict[str, str] = {}

    def attempt(name: str, fn: Callable[[], Any], must_refuse: bool) -> None:
        try:
            fn()
        except CkptError as e:
            refused[name] = f"{type(e).__name__}: {str(e)[:160]}"
            return
        except BaseException as e:  # noqa: BLE001 - the point: anything else is a failure
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            return
        if must_refuse:
            failures.append(f"{name}: accepted")

    rng = random.Random(args.seed)
    for i in range(args.iterations):
        seed, parse = (mbytes, parse_manifest) if i % 2 == 0 else (ibytes, index)
        b = bytearray(seed)
        for _ in range(rng.randint(1, 8)):
            pos = rng.randrange(len(b)) if b else 0
            op = rng.randrange(4)
            if op == 0 and b:
                b[pos] = rng.randrange(256)
            elif op == 1 and b:
                del b[pos]
            elif op == 2:
                b.insert(pos, rng.choice(b'{}[]",:0123456789-.eE nulltrue'))
            elif b:
                del b[pos:]
        data = bytes(b)
        try:
            parse(data)
        except CkptError:
            pass
        except BaseException as e:  # noqa: BLE001
            failures.append(
                f"mutation {i}: {type(e).__name__}: {str(e)[:200]} input={data[:200]!r}"
            )

    n = (args.bomb_mib << 20) // 3
    idoc = json.loads(ibytes)
    mdoc = json.loads(mbytes)

    def with_field(doc: dict[str, Any], field: str, filler: str) -> bytes:
        marker = "@@FILL@@"
        text = json.dumps(dict(doc, **{field: marker}))
        return text.replace(json.dumps(marker), filler).encode()

    # Each bomb is built just before it is parsed and dropped after, so the limit's
    # headroom holds one bomb's bytes, not all seven (about 8 x B MiB) at once.
    bombs: dict[str, tuple[Callable[[bytes], Any], Callable[[], bytes]]] = {
        # Millions of entries (tiny ones: the most objects per byte).
        "index-million-entries": (
            index,
            lambda: with_field(idoc, "entries", "[" + "{}," * n + "{}]"),
        ),
        "index-million-lists": (
            index,
            lambda: with_field(idoc, "entries", "[" + "[]," * n + "[]]"),
        ),
        "manifest-million-shards": (
            parse_manifest,
            lambda: with_field(mdoc, "shards", "[" + "{}," * n + "{}]"),
        ),
        "manifest-deep-nesting": (parse_manifest, lambda: b"[" * (3 * n) + b"]" * (3 * n)),
        "manifest-huge-int": (
            parse_manifest,
            lambda: with_field(mdoc, "generation", "9" * (3 * n)),
        ),
        "manifest-huge-key": (
            parse_manifest,
            lambda: with_field(mdoc, "job", '"' + "a" * (3 * n) + '"'),
        ),
        "state-million-nodes": (
            parse_manifest,
            lambda: with_field(mdoc, "state", '{"list":[' + '{"list":[]},' * (n // 4) + "1]}"),
        ),
    }
    sizes = {}
    for name, (parse, build) in bombs.items():
        data = build()
        sizes[name] = len(data)
        # A hash of the bytes first, as the reader does before parsing (index digests).
        hashing.digest(data)
        attempt(
            name,
            lambda parse=parse, data=data: parse(data),
            must_refuse=name != "state-million-nodes",
        )
        del data
    print(
        json.dumps(
            {
                "failures": failures,
                "refused": refused,
                "bomb_bytes": sizes,
                "base_rss_mib": base_rss,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
                "as_limit_mib": args.as_limit_mib,
            }
        )
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
