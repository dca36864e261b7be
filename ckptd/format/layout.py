"""Where things live inside a job's checkpoint directory (format v1).

    <job>/step-<step:012d>/MANIFEST.json          the commit point, written last
    <job>/step-<step:012d>/shards/rank-<r:05d>.bin
    <job>/step-<step:012d>/shards/rank-<r:05d>.json

Every path ckptd reads from a manifest or index is relative to the step directory and is
checked by `check_relative` before use: no absolute paths, no `..`, no NUL, bounded
length. Symlinks are refused by the storage layer (O_NOFOLLOW + realpath confinement).
"""

from __future__ import annotations

import re

from ckptd.errors import UnsafePath

MANIFEST_NAME = "MANIFEST.json"
SHARDS_DIR = "shards"
STEP_PREFIX = "step-"
MAX_STEP = 10**12 - 1
MAX_RANK = 10**5 - 1
MAX_RELPATH = 1024

_STEP_RE = re.compile(r"^step-(\d{12})$")
_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9._-]+$")


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


def check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
    return step


def check_rank(rank: object) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_RANK:
        raise ValueError(f"rank must be an integer in [0, {MAX_RANK}], got {rank!r}")
    return rank


def check_relative(path: object, *, what: str = "path") -> str:
    """Validate a path read from a manifest/index: relative, normalized, confined."""
    if not isinstance(path, str):
        raise UnsafePath(f"{what} must be a string, got {type(path).__name__}")
    if not path or len(path) > MAX_RELPATH:
        raise UnsafePath(f"{what} {path[:80]!r} is empty or longer than {MAX_RELPATH} chars")
    if path.startswith("/") or "\\" in path:
        raise UnsafePath(f"{what} {path!r} is absolute; only paths inside the step are allowed")
    for part in path.split("/"):
        if part in ("", ".", "..") or not _SAFE_COMPONENT.match(part):
            raise UnsafePath(
                f"{what} {path!r} has an unsafe component {part!r}; "
                "only [A-Za-z0-9._-] names inside the checkpoint directory are allowed"
            )
    return path
