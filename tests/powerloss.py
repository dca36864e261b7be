"""Power-loss simulation for the local storage path (ckptd.storage.local).

`PowerLoss(root)` replaces the `os` module that ckptd.storage.local calls (and
shutil.rmtree, which its remove_tree uses) with recording versions that still do the
real call, and keeps a model of what a power cut would leave of the tree under `root`:

- a file's bytes are durable as of its last successful fsync (read back at that moment);
  bytes written after it, or never fsynced, are lost;
- a directory entry change (create, mkdir, unlink, rmtree, rename) is durable only once
  its directory is fsynced after it; a rename is atomic (both names change together) and
  becomes durable with an fsync of its destination directory;
- everything else is lost.

This is the pessimistic reading of POSIX that crash-consistency checkers (ALICE,
CrashMonkey) use; real filesystems often keep more, never less. The durable state only
changes at an fsync, so an image taken after each fsync covers every moment a crash can
happen during the run; `images` holds them and `materialize` writes one out as a real
directory tree to run ckptd's own listing, verification and loading on. Two names of one
inode (a rename whose source side survives) are materialized as hard links.

What is outside the model: calls made by other code (SQLite's catalog, a fresh rank
process); anything found on disk that the model does not know is adopted as durable,
and listed in `adopted`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from ckptd.storage import local

_real_rmtree = shutil.rmtree


@dataclasses.dataclass
class Image:
    """The durable state right after one fsync: what a power cut at that moment leaves."""

    seq: int  # the fsync's position in the op log
    saving: int | None  # the step being saved (set with PowerLoss.phase)
    acked: tuple[int, ...]  # steps whose save had returned (been acknowledged) by then
    entries: dict[int, dict[str, int]]  # directory inode -> {name: inode}
    data: dict[int, bytes]  # file inode -> durable bytes


class PowerLoss:
    def __init__(self, root: str | os.PathLike[str]):
        self.root = os.path.realpath(os.fspath(root))
        self._lock = threading.RLock()
        self._next = 1
        self.kind: dict[int, str] = {0: "d"}
        self.vol: dict[int, dict[str, int]] = {0: {}}  # what is on disk now
        self.dur: dict[int, dict[str, int]] = {0: {}}  # what a crash would leave
        self.data: dict[int, bytes] = {}
        self.pending: list[tuple[int, tuple[Any, ...]]] = []  # (home directory, op)
        self.fds: dict[int, int] = {}
        self.log: list[str] = []
        self.adopted: list[str] = []
        self.images: list[Image] = []
        self.saving: int | None = None
        self.acked: list[int] = []
        os.makedirs(self.root, exist_ok=True)
        self._adopt_tree(0, self.root)
        self._snapshot()

    # -- recording --------------------------------------------------------------------
    @contextmanager
    def recording(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[PowerLoss]:
        monkeypatch.setattr(local, "os", _OsProxy(self))
        monkeypatch.setattr(shutil, "rmtree", self._rmtree)
        try:
            yield self
        finally:
            monkeypatch.setattr(local, "os", os)
            monkeypatch.setattr(shutil, "rmtree", _real_rmtree)

    def phase(self, saving: int | None) -> None:
        """From now on the test is saving step `saving` (None: between saves)."""
        self.saving = saving

    def ack(self, step: int) -> None:
        """The save of `step` returned: a crash from now on must not lose it."""
        with self._lock:
            self.acked.append(step)
            self._snapshot()  # the moment right after the acknowledgement

    # -- the model --------------------------------------------------------------------
    def _new(self, kind: str) -> int:
        ino = self._next
        self._next += 1
        self.kind[ino] = kind
        if kind == "d":
            self.vol[ino], self.dur[ino] = {}, {}
        return ino

    def _adopt_tree(self, ino: int, path: str) -> None:
        for name in sorted(os.listdir(path)):
            self._adopt(ino, name, os.path.join(path, name))

    def _adopt(self, parent: int, name: str, path: str) -> int:
        """Something on disk the model does not know: taken as durable."""
        child = self._new("d" if os.path.isdir(path) and not os.path.islink(path) else "f")
        self.vol[parent][name] = self.dur[parent][name] = child
        if self.kind[child] == "d":
            self._adopt_tree(child, path)
        else:
            with open(path, "rb") as f:
                self.data[child] = f.read()
        if self.images:  # not the initial tree
            self.adopted.append(path)
        return child

    def _inside(self, path: Any) -> str | None:
        if not isinstance(path, (str, os.PathLike)):
            return None
        p = os.path.abspath(os.fspath(path))
        if p == self.root or p.startswith(self.root + "/"):
            return p
        return None

    def _parts(self, p: str) -> list[str]:
        rel = os.path.relpath(p, self.root)
        return [] if rel == "." else rel.split("/")

    def _lookup(self, p: str) -> int | None:
        ino = 0
        cur = self.root
        for part in self._parts(p):
            cur = os.path.join(cur, part)
            nxt = self.vol.get(ino, {}).get(part)
            if nxt is None:
                if not os.path.lexists(cur):
                    return None
                nxt = self._adopt(ino, part, cur)
            ino = nxt
        return ino

    def _parent(self, p: str) -> tuple[int, str]:
        parent = self._lookup(os.path.dirname(p))
        assert parent is not None, f"power-loss model: no parent directory for {p}"
        return parent, os.path.basename(p)

    def _op(self, home: int, op: tuple[Any, ...], text: str) -> None:
        self.pending.append((home, op))
        self.log.append(text)

    def _apply(self, op: tuple[Any, ...]) -> None:
        if op[0] == "create":
            _, d, name, ino = op
            self.dur[d][name] = ino
        elif op[0] == "unlink":
            _, d, name, ino = op
            if self.dur[d].get(name) == ino:
                del self.dur[d][name]
        elif op[0] == "rename":
            _, sd, sname, dd, dname, ino = op
            if self.dur[sd].get(sname) == ino:
                del self.dur[sd][sname]
            self.dur[dd][dname] = ino

    def _snapshot(self) -> None:
        self.images.append(
            Image(
                seq=len(self.log),
                saving=self.saving,
                acked=tuple(self.acked),
                entries={d: dict(m) for d, m in self.dur.items()},
                data=dict(self.data),
            )
        )

    # -- the calls LocalStorage makes ----------------------------------------------------
    def open(self, path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        p = self._inside(path)
        if p is None or kw:
            return os.open(path, flags, mode, **kw)
        with self._lock:
            existed = self._lookup(p) is not None
            fd = os.open(path, flags, mode)
            if flags & os.O_CREAT and not existed:
                parent, name = self._parent(p)
                ino = self._new("f")
                self.vol[parent][name] = ino
                self._op(parent, ("create", parent, name, ino), f"create {p}")
            ino = self._lookup(p)
            if ino is not None:
                self.fds[fd] = ino
            return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self.fds.pop(fd, None)
        os.close(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)  # a failure raises and makes nothing durable
        with self._lock:
            ino = self.fds.get(fd)
            if ino is None:
                return
            if self.kind[ino] == "d":
                mine = [op for home, op in self.pending if home == ino]
                self.pending = [(h, op) for h, op in self.pending if h != ino]
                for op in mine:
                    self._apply(op)
                self.log.append(f"fsync dir #{ino} ({len(mine)} entry changes)")
            else:
                rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
                try:
                    chunks = []
                    while chunk := os.read(rfd, 1 << 20):
                        chunks.append(chunk)
                finally:
                    os.close(rfd)
                self.data[ino] = b"".join(chunks)
                self.log.append(f"fsync file #{ino} ({len(self.data[ino])} bytes)")
            self._snapshot()

    def rename(self, src: Any, dst: Any) -> None:
        s, d = self._inside(src), self._inside(dst)
        if s is None or d is None:
            return os.rename(src, dst)
        with self._lock:
            ino = self._lookup(s)
            os.rename(src, dst)
            assert ino is not None
            sp, sname = self._parent(s)
            dp, dname = self._parent(d)
            del self.vol[sp][sname]
            self.vol[dp][dname] = ino
            self._op(dp, ("rename", sp, sname, dp, dname, ino), f"rename {s} -> {d}")
        return None

    def unlink(self, path: Any) -> None:
        p = self._inside(path)
        if p is None:
            return os.unlink(path)
        with self._lock:
            ino = self._lookup(p)
            os.unlink(path)
            parent, name = self._parent(p)
            self.vol[parent].pop(name, None)
            self._op(parent, ("unlink", parent, name, ino), f"unlink {p}")
        return None

    def makedirs(self, path: Any, mode: int = 0o777, exist_ok: bool = False) -> None:
        p = self._inside(path)
        if p is None:
            return os.makedirs(path, mode, exist_ok)
        with self._lock:
            missing = []
            d = p
            while not os.path.isdir(d):
                missing.append(d)
                d = os.path.dirname(d)
            os.makedirs(path, mode, exist_ok)
            for d in reversed(missing):
                parent, name = self._parent(d)
                ino = self._new("d")
                self.vol[parent][name] = ino
                self._op(parent, ("create", parent, name, ino), f"mkdir {d}")
        return None

    def _rmtree(self, path: Any, *a: Any, **kw: Any) -> None:
        p = self._inside(path)
        if p is None:
            return _real_rmtree(path, *a, **kw)
        with self._lock:
            ino = self._lookup(p)
            _real_rmtree(path, *a, **kw)
            parent, name = self._parent(p)
            self.vol[parent].pop(name, None)
            self._op(parent, ("unlink", parent, name, ino), f"rmtree {p}")
        return None


class _OsProxy:
    """`os` for ckptd.storage.local: the namespace calls recorded, the rest passed through."""

    def __init__(self, sim: PowerLoss):
        self._sim = sim
        for name in ("open", "close", "fsync", "rename", "unlink", "makedirs"):
            setattr(self, name, getattr(sim, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def reachable(image: Image, kind: dict[int, str]) -> dict[str, Any]:
    """{path: inode-or-None-for-directories} of what the image holds, for telling images apart."""
    out: dict[str, Any] = {}

    def walk(ino: int, path: str) -> None:
        for name, child in image.entries.get(ino, {}).items():
            p = f"{path}/{name}"
            if kind[child] == "d":
                out[p] = None
                walk(child, p)
            else:
                out[p] = (child, len(image.data.get(child, b"")), hash(image.data.get(child)))

    walk(0, "")
    return out


def materialize(image: Image, kind: dict[int, str], dest: str) -> None:
    """Write what the crash left as a real tree at `dest` (fresh directory)."""
    os.makedirs(dest)
    first_path: dict[int, str] = {}

    def walk(ino: int, path: str) -> None:
        for name, child in sorted(image.entries.get(ino, {}).items()):
            p = os.path.join(path, name)
            if kind[child] == "d":
                os.mkdir(p)
                walk(child, p)
            elif child in first_path:
                os.link(first_path[child], p)
            else:
                with open(p, "wb") as f:
                    f.write(image.data.get(child, b""))
                first_path[child] = p

    walk(0, dest)
