"""Where a job lives: one type that tells a local directory from a storage URL.

A job (or a coordinator's root, a directory of jobs) is named by a local path or by an
fsspec URL (s3://bucket/job, memory://name). `JobLocation.of` normalises it once, and
every part of ckptd that needs to know which it is asks the location instead of looking
for "://" itself:

    local path     made absolute, symlinks resolved (realpath): one job, one name
    file:///p      a local path (the same bytes as /p, opened by LocalStorage)
    URL            kept as written, trailing '/' removed

It also knows a job's place under a root (`job_name`, `job_dir`, both confined) and where
the embedded coordinator keeps the job's SQLite catalog: beside the job on a local disk,
else (a network filesystem, where SQLite's locking is unsafe, or an object store, where
it cannot live) under `$CKPTD_CATALOG_DIR/<hash>/` or `~/.cache/ckptd/catalogs/<hash>/`,
the hash being of the normalised path; a job on a read-only mount has its catalog there
too (a job resumes and loads from read-only storage; its saves fail with EROFS).
`$CKPTD_CATALOG_DIR`, when set, wins, except for a store that lives in this process alone
(memory://): its catalog lives and dies with the process, in a temporary directory.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import shutil
import tempfile
import threading

from ckptd.errors import UnsafePath
from ckptd.storage.paths import check_name

# Filesystems on which SQLite's locking and WAL are not safe (and whose latency makes a
# catalog slow): a catalog is never put there by default.
NETWORK_FS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "cifs",
        "smb3",
        "smbfs",
        "gpfs",
        "beegfs",
        "fuse.sshfs",
        "9p",
        "ceph",
        "fuse.glusterfs",
        "glusterfs",
        "afs",
        "panfs",
        "fuse.juicefs",
        "fuse.s3fs",
        "fuse.gcsfuse",
    }
)

CATALOG_NAME = "catalog.sqlite"
CATALOG_DIR_ENV = "CKPTD_CATALOG_DIR"
_CATALOG_CACHE = "~/.cache/ckptd/catalogs"
# Protocols whose store lives in this process alone: a catalog of theirs must not outlive it
# (another process would find steps listed that its own empty store lacks).
PROCESS_LOCAL = frozenset({"memory"})
_process_dir: str | None = None
_process_dir_lock = threading.Lock()


def _process_catalogs() -> str:
    """A directory of this process's own, removed at exit (for PROCESS_LOCAL jobs)."""
    global _process_dir
    with _process_dir_lock:
        if _process_dir is None:
            _process_dir = tempfile.mkdtemp(prefix="ckptd-catalogs-")
            atexit.register(shutil.rmtree, _process_dir, ignore_errors=True)
        return _process_dir


_FILE = "file://"


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding `path`, from /proc/self/mountinfo ('' if unknown)."""
    path = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount = fields[4].replace("\\040", " ")
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(
                    mount
                ) >= len(best):
                    best, fstype = mount, right.split()[0]
    except OSError:
        return ""
    return fstype


def is_read_only(path: str) -> bool:
    """True when `path` (or, if it does not exist, its nearest existing parent) is on a
    filesystem mounted read-only."""
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    try:
        return bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def local_dir(path: str) -> str:
    """A local directory's one name: absolute, symlinks resolved; refuses NUL."""
    if "\0" in path:
        raise UnsafePath(f"checkpoint path {path!r} contains a NUL byte")
    return os.path.realpath(os.path.abspath(path))


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith(_FILE)


def _normalise(path: str) -> str:
    if _is_url(path):
        scheme, rest = path.split("://", 1)
        return f"{scheme}://{rest.rstrip('/')}"  # memory://x/ -> memory://x; s3:// stays
    if path.startswith(_FILE):
        path = path[len(_FILE) :]
    return local_dir(path)


@dataclasses.dataclass(frozen=True)
class JobLocation:
    """A job's location (or a coordinator root's), normalised: see the module docstring.

    `path` is the normalised form, the one to compare, record and pass on; two spellings
    of one job (a relative path, a symlink, a trailing '/') make equal locations.
    """

    path: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _normalise(self.path))

    @classmethod
    def of(cls, path: str | os.PathLike[str] | JobLocation) -> JobLocation:
        if isinstance(path, JobLocation):
            return path
        return cls(os.fspath(path))

    def __str__(self) -> str:
        return self.path

    @property
    def is_url(self) -> bool:
        """True for a storage URL (s3://, memory://, ...); False for a local path."""
        return _is_url(self.path)

    @property
    def protocol(self) -> str:
        """The URL's scheme ('s3', 'memory', ...); '' for a local path."""
        return self.path.split("://", 1)[0] if self.is_url else ""

    @property
    def parent(self) -> str:
        """The directory (or URL prefix) holding this one: the embedded coordinator's root
        (memory://job's is memory://, s3://bucket/job's s3://bucket)."""
        if self.is_url:
            scheme, rest = self.path.split("://", 1)
            return f"{scheme}://{rest.rsplit('/', 1)[0] if '/' in rest else ''}"
        return os.path.dirname(self.path)

    @property
    def name(self) -> str:
        """The last component of the path."""
        return self.path.rsplit("/", 1)[-1]

    def _prefix(self) -> str:
        # What every path under this one starts with ("s3://" is already a prefix).
        return self.path if self.path.endswith("/") else self.path + "/"

    # -- a root: the directory of jobs a coordinator serves -------------------------------
    def job_name(self, job: str) -> str:
        """`job` (absolute, relative to this root, or a URL under it) as a path relative
        to this root; refuses anything outside it or with an unsafe component.

        Each component is any one directory name a user may give their job (check_name:
        `lr=3e-4,bs=64`, `my run`, `実験`), the same for `ckptd serve` and the embedded
        coordinator; what is refused is a way out of the root or a name two ways: '..',
        '.', empty components, separators, NUL and control characters."""
        if self.is_url:
            prefix = self._prefix()
            rel = job[len(prefix) :] if job.startswith(prefix) else job
            if "://" in rel:
                raise UnsafePath(f"job {job!r} is outside the coordinator's root {self.path}")
        else:
            for part in job.split("/"):
                # Before normpath folds 'a/../b' into 'b': a '..' is never part of a job.
                if part in (".", ".."):
                    raise UnsafePath(
                        f"job {job!r} has a {part!r} component, outside the coordinator's "
                        f"root {self.path}; name the job's directory under the root"
                    )
            full = job if os.path.isabs(job) else os.path.join(self.path, job)
            full = os.path.normpath(full)
            if full != self.path and not full.startswith(self._prefix()):
                raise UnsafePath(
                    f"job {job!r} is outside the coordinator's root {self.path}; "
                    "save under the root the coordinator serves"
                )
            rel = os.path.relpath(full, self.path)
        for part in rel.split("/"):
            check_name(part, what=f"job {job!r} component")
        return rel

    def job_dir(self, name: str) -> str:
        """The path of the job `name` (from `job_name`) under this root; refuses a local
        job directory that resolves, through a symlink, outside the root."""
        path = f"{self._prefix()}{name}"
        if not self.is_url:
            real = os.path.realpath(path)
            if real != self.path and not real.startswith(self._prefix()):
                raise UnsafePath(
                    f"job {name!r} resolves through a symlink to {real}, outside {self.path}"
                )
        return path

    @property
    def read_only(self) -> bool:
        """True for a local job on a read-only mount (its catalog cannot live beside it)."""
        return not self.is_url and is_read_only(self.path)

    # -- catalogs --------------------------------------------------------------------------
    @property
    def catalog_beside(self) -> str:
        """`<path>/.ckptd/catalog.sqlite`: where `ckptd serve` keeps its root's catalog, and
        the embedded coordinator a job's on a local disk."""
        return os.path.join(self.path, ".ckptd", CATALOG_NAME)

    def catalog_path(self) -> str:
        """Where the embedded coordinator keeps this job's catalog (module docstring)."""
        digest = hashlib.sha256(self.path.encode()).hexdigest()[:16]
        if self.protocol in PROCESS_LOCAL:
            return os.path.join(_process_catalogs(), digest, CATALOG_NAME)
        override = os.environ.get(CATALOG_DIR_ENV)
        if override:
            return os.path.join(override, digest, CATALOG_NAME)
        if not self.is_url:
            probe = self.path
            while not os.path.exists(probe):
                probe = os.path.dirname(probe) or "/"
            if filesystem_type(probe) not in NETWORK_FS and not self.read_only:
                return self.catalog_beside
        return os.path.join(os.path.expanduser(_CATALOG_CACHE), digest, CATALOG_NAME)
