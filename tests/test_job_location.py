"""Where a job lives (ckptd.storage.location.JobLocation), and storage's independence.

One type names a job: a local path (absolute, symlinks resolved), file:// (a local
path), or a storage URL (trailing '/' removed). It knows a job's parent (the embedded
coordinator's root), a job's name and directory under a root (confined), and the default
catalog: beside the job on a local disk, else $CKPTD_CATALOG_DIR/<hash>/ or
~/.cache/ckptd/catalogs/<hash>/. Also here: the storage package imports nothing of the
format or anything above it, and the commit's crash point fires with the manifest durable
under its temporary name only.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from coordinator_fixtures import child_env

import ckpt
from ckptd.errors import UnsafePath
from ckptd.format import checkpoint as ckfmt
from ckptd.format import layout
from ckptd.storage import JobLocation, LocalStorage, location, open_storage

pytestmark = pytest.mark.timeout(60)


def _digest(path: str) -> str:
    return hashlib.sha256(path.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- normal forms


def test_a_local_path_is_absolute_with_symlinks_resolved(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    want = os.path.realpath(real / "job")
    for spelling in (tmp_path / "link" / "job", f"{tmp_path}/link/job/", str(real / "job")):
        loc = JobLocation.of(spelling)
        assert loc.path == want and not loc.is_url and loc.protocol == ""
        assert loc == JobLocation.of(want)
    assert JobLocation.of(want).parent == os.path.realpath(real)
    assert JobLocation.of(want).name == "job"


def test_a_relative_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert JobLocation.of("runs/a").path == os.path.join(os.path.realpath(tmp_path), "runs", "a")
    assert JobLocation("runs/a") == JobLocation.of(Path("runs") / "a")  # the constructor too


def test_a_url_keeps_its_form_without_the_trailing_slash() -> None:
    loc = JobLocation.of("s3://bucket/team/job/")
    assert loc.path == "s3://bucket/team/job" and str(loc) == loc.path
    assert loc.is_url and loc.protocol == "s3"
    assert loc.parent == "s3://bucket/team" and loc.name == "job"
    # A job at the top of a store: its parent is the store itself, still a URL.
    top = JobLocation.of("memory://job/")
    assert top.path == "memory://job" and top.parent == "memory://"
    assert JobLocation.of(top.parent).is_url


def test_file_urls_are_local_paths(tmp_path: Path) -> None:
    loc = JobLocation.of(f"file://{tmp_path}/job/")
    assert not loc.is_url and loc.path == os.path.realpath(tmp_path / "job")
    st = open_storage(f"file://{tmp_path}/job", create=True)
    assert isinstance(st, LocalStorage) and st.root == loc.path


def test_a_nul_byte_is_refused() -> None:
    with pytest.raises(UnsafePath, match="NUL"):
        JobLocation.of("job\0x")


# ----------------------------------------------------------------------------- under a root


def test_job_names_under_a_local_root(tmp_path: Path) -> None:
    root = JobLocation.of(tmp_path / "root")
    assert root.job_name("team/a") == "team/a"
    assert root.job_name(f"{root.path}/team/a") == "team/a"
    for outside in ("../x", "/etc", "team/../../x"):
        with pytest.raises(UnsafePath, match="outside"):
            root.job_name(outside)
    for name in ("my job", "lr=3e-4,bs=64", "exp+v2", "実験", "team/my run"):
        assert root.job_name(name) == name  # any name its user gives a job
    for bad in ("job\nx", "job\tx", "job\x7f", "team/./job", "team/../job"):
        with pytest.raises(UnsafePath):
            root.job_name(bad)
    assert root.job_dir("team/a") == f"{root.path}/team/a"
    (tmp_path / "root").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "root" / "linked")
    with pytest.raises(UnsafePath, match="symlink"):
        root.job_dir("linked")


def test_job_names_under_a_url_root() -> None:
    root = JobLocation.of("s3://bucket/runs/")
    assert root.job_name("s3://bucket/runs/team/a") == "team/a"
    assert root.job_name("team/a") == "team/a"
    assert root.job_dir("team/a") == "s3://bucket/runs/team/a"
    with pytest.raises(UnsafePath, match="outside"):
        root.job_name("s3://other/team/a")
    store = JobLocation.of("memory://")
    assert store.job_name("memory://job") == "job" and store.job_dir("job") == "memory://job"


# ----------------------------------------------------------------------------- the catalog


def test_the_catalog_lives_beside_a_job_on_a_local_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPTD_CATALOG_DIR", raising=False)
    monkeypatch.setattr(location, "filesystem_type", lambda path: "ext4")
    loc = JobLocation.of(tmp_path / "not-yet" / "job")  # probed up to a directory that exists
    assert loc.catalog_path() == os.path.join(loc.path, ".ckptd", "catalog.sqlite")
    assert loc.catalog_beside == loc.catalog_path()


def test_the_catalog_leaves_a_network_filesystem_and_an_object_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPTD_CATALOG_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(location, "filesystem_type", lambda path: "nfs4")
    loc = JobLocation.of(tmp_path / "job")
    cache = tmp_path / "home" / ".cache" / "ckptd" / "catalogs"
    assert loc.catalog_path() == str(cache / _digest(loc.path) / "catalog.sqlite")
    url = JobLocation.of("s3://bucket/job/")
    assert url.catalog_path() == str(cache / _digest("s3://bucket/job") / "catalog.sqlite")


def test_ckptd_catalog_dir_overrides_every_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_CATALOG_DIR", str(tmp_path / "cats"))
    for spelling in (tmp_path / "job", "s3://bucket/job"):
        loc = JobLocation.of(spelling)
        want = tmp_path / "cats" / _digest(loc.path) / "catalog.sqlite"
        assert loc.catalog_path() == str(want)


def test_a_checkpointer_on_a_job_at_the_top_of_a_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """memory://name: the embedded coordinator serves memory:// (on main its root came out
    as the local path 'memory:/', and every save was refused as an unsafe job name)."""
    monkeypatch.setenv("CKPTD_CATALOG_DIR", str(tmp_path / "cats"))
    job = f"memory://ckptd-test-{uuid.uuid4().hex}"
    try:
        with ckpt.Checkpointer(job + "/") as cp:
            assert cp.path == job
            cp.save({"w": torch.arange(4.0)}, 1).wait()
            got = cp.load({"w": torch.zeros(4)})
        assert got.step == 1 and torch.equal(got.state["w"], torch.arange(4.0))
        assert ckfmt.committed_steps(open_storage(job)) == [1]
    finally:
        fsspec.filesystem("memory").rm("/" + job[len("memory://") :], recursive=True)


# ----------------------------------------------------------------------------- layering


def test_the_storage_package_imports_nothing_above_it() -> None:
    code = (
        "import sys\n"
        "import ckptd.storage, ckptd.storage.local, ckptd.storage.fsspec_store\n"
        "import ckptd.storage.location, ckptd.storage.paths\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[:2] in (\n"
        "    ['ckptd', 'format'], ['ckptd', 'coordinator'], ['ckptd', 'server'],\n"
        "    ['ckptd', 'cli']) or m.split('.')[0] == 'ckpt')\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"ckptd.storage imported {out.stdout.strip()}"


def test_the_commit_crash_point_fires_with_the_manifest_durable_but_unpublished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt.save({"w": torch.arange(8.0)}, tmp_path / "job", step=1)
    st = open_storage(tmp_path / "job")
    manifest = ckfmt.read_manifest(st, 1)
    sdir = tmp_path / "job" / layout.step_dir(1)
    (sdir / layout.MANIFEST_NAME).unlink()
    seen: list[tuple[str, list[str], bytes]] = []

    def point(name: str) -> None:
        files = sorted(os.listdir(sdir))
        tmps = [f for f in files if f.startswith(layout.MANIFEST_NAME + ".tmp")]
        seen.append((name, files, b"".join((sdir / f).read_bytes() for f in tmps)))

    monkeypatch.setattr(ckfmt, "crash_point", point)
    data = ckfmt.commit(st, manifest)
    [(name, files, staged)] = seen
    assert name == "coordinator.mid_manifest"
    assert layout.MANIFEST_NAME not in files  # not yet published...
    assert staged == data  # ...but whole under its temporary name
    assert sorted(os.listdir(sdir)) == sorted([layout.MANIFEST_NAME, layout.SHARDS_DIR])
    assert (sdir / layout.MANIFEST_NAME).read_bytes() == data


def test_a_memory_job_s_catalog_dies_with_its_process(tmp_path):
    """memory:// is one process's store: a catalog kept for it in ~/.cache told the next
    process that steps its empty store lacks were committed (CheckpointExists at step 1)."""
    code = (
        "import torch, ckpt\n"
        "print(ckpt.save({'w': torch.ones(2)}, 'memory://same-name-every-run', step=1).step)\n"
    )
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("CKPTD_CATALOG_DIR", None)
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr[-2000:]
    assert not (tmp_path / ".cache" / "ckptd").exists()
