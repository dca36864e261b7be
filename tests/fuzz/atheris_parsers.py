"""Coverage-guided fuzzing (atheris / libFuzzer) of the manifest and shard index parsers.

    python tests/fuzz/atheris_parsers.py CORPUS_DIR -runs=100000 -rss_limit_mb=2048

CORPUS_DIR holds seeds (a real MANIFEST.json and shard index: tests/test_parse_limits.py
writes them). Each input is parsed as a manifest and as an index of a fixed manifest;
anything but success or a CkptError is a crash that libFuzzer reports with the input.
libFuzzer's -rss_limit_mb and -timeout bound memory and time per input.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from ckptd.errors import CkptError
    from ckptd.format.manifest import Manifest, ShardInfo, parse_index, parse_manifest

MANIFEST = Manifest(
    job="job",
    step=1,
    generation=0,
    world_size=1,
    block_size=16 << 20,
    alignment=4096,
    shards=[
        ShardInfo(0, "shards/rank-00000.bin", 1 << 20, "shards/rank-00000.json", 1000, "0" * 64)
    ],
    state=None,
)


def one_input(data: bytes) -> None:
    try:
        parse_manifest(data)
    except CkptError:
        pass
    try:
        parse_index(
            data, manifest=MANIFEST, shard=MANIFEST.shards[0], max_entries=10_000, what="fuzz"
        )
    except CkptError:
        pass


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
