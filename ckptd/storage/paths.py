"""Path confinement: which relative paths a Storage accepts.

Every path a Storage takes is '/'-separated and relative to its root. `check_relative`
refuses anything that could leave the root or be read two ways: absolute paths, `..`,
`.`, empty components, backslashes, NUL and other characters outside [A-Za-z0-9._-], and
paths over MAX_RELPATH characters. The format checks the paths it reads from manifests
and indexes with the same function, so what a manifest may name and what storage may
open are one rule. Symlinks are refused by each backend (LocalStorage: O_NOFOLLOW and
realpath confinement).
"""

from __future__ import annotations

import re

from ckptd.errors import UnsafePath

MAX_RELPATH = 1024

_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9._-]+$")


def check_relative(path: object, *, what: str = "path") -> str:
    """Validate a relative path: a string of safe components, confined to the root."""
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


MAX_NAME_BYTES = 255  # one directory entry on Linux filesystems


def check_name(name: object, *, what: str = "name") -> str:
    """Validate one directory name that a user chose (a job's own directory): any
    characters a filesystem takes in one entry, but never a way out of its parent: not
    empty, `.` or `..`, no '/', backslash, NUL or control character, at most 255 bytes."""
    if not isinstance(name, str):
        raise UnsafePath(f"{what} must be a string, got {type(name).__name__}")
    if (
        name in ("", ".", "..")
        or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
        or any(c in "/\\" or ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        raise UnsafePath(
            f"{what} {name[:80]!r} is not one safe directory name (empty, '.', '..', a "
            f"separator, a control character, or over {MAX_NAME_BYTES} bytes)"
        )
    return name
