"""Where things live inside a job's checkpoint directory (format v1).

    <job>/step-<step:012d>/MANIFEST.json          the commit point, written last
    <job>/step-<step:012d>/shards/rank-<r:05d>.bin
    <job>/step-<step:012d>/shards/rank-<r:05d>.json

Every path ckptd reads from a manifest or index is relative to the step directory and is
checked before use by the storage layer's own confinement rule
(`ckptd.storage.paths.check_relative`: no absolute paths, no `..`, no NUL, bounded
length); symlinks are refused by the storage layer too (O_NOFOLLOW + realpath).
"""

from __future__ import annotations

import re

MANIFEST_NAME = "MANIFEST.json"
SHARDS_DIR = "shards"
STEP_PREFIX = "step-"
MAX_STEP = 10**12 - 1
MAX_RANK = 10**5 - 1

_STEP_RE = re.compile(r"^step-(\d{12})$")
# An index entry's file in another step's directory (format version 3, incremental saves):
# `../step-<12 digits>/<path in that step>`, the only form of `..` a format path may take.
_BORROWED_RE = re.compile(r"^\.\./step-(\d{12})/(.+)$")


def step_dir(step: int) -> str:
    check_step(step)
    return f"{STEP_PREFIX}{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a directory name, or None for anything that is not a step directory."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def _generation_suffix(generation: int) -> str:
    # Generation 0 keeps the plain name. Later generations get their own file names, so a
    # fenced rank of an older generation that wakes up can never write into a newer
    # generation's shard of the same step.
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError(f"generation must be a non-negative integer, got {generation!r}")
    return f".g{generation}" if generation else ""


def shard_name(rank: int, generation: int = 0) -> str:
    check_rank(rank)
    return f"{SHARDS_DIR}/rank-{rank:05d}{_generation_suffix(generation)}.bin"


def index_name(rank: int, generation: int = 0) -> str:
    check_rank(rank)
    return f"{SHARDS_DIR}/rank-{rank:05d}{_generation_suffix(generation)}.json"


def borrowed_file(step: int, file: str) -> str:
    """How an index entry names `file` of step `step`'s directory from a sibling step's."""
    return f"../{step_dir(step)}/{file}"


def split_borrowed(file: str) -> tuple[int, str] | None:
    """(step, path inside that step) of a borrowed entry's file; None for a file of the
    entry's own step. The path is the caller's to confine (check_relative)."""
    if not file.startswith("../"):  # an own file, nearly every entry: no pattern to run
        return None
    m = _BORROWED_RE.match(file)
    return (int(m.group(1)), m.group(2)) if m else None


def job_path(step: int, file: str) -> str:
    """An index entry's file of step `step`, relative to the job directory: its own step's
    directory, or the one a borrowed file names (never outside the job)."""
    got = split_borrowed(file)
    return f"{step_dir(got[0])}/{got[1]}" if got else f"{step_dir(step)}/{file}"


def check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
    return step


def check_rank(rank: object) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_RANK:
        raise ValueError(f"rank must be an integer in [0, {MAX_RANK}], got {rank!r}")
    return rank
