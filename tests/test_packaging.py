"""The wheel as a user installs it: built from the tree by pip, its file list checked.

PEP 561: type checkers use the annotations of an installed package only when it carries a
`py.typed` marker, so both packages of the wheel (ckptd and the client library ckpt) must.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _source_tree(dest: Path) -> Path:
    """What the wheel is built from, copied (a build writes build/ and *.egg-info beside
    its sources, which must not land in the worktree under other tests)."""
    dest.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "ckptd", dest / "ckptd", ignore=ignore)
    shutil.copytree(REPO / "clients", dest / "clients", ignore=ignore)
    return dest


def test_the_wheel_carries_py_typed_for_both_packages(tmp_path: Path) -> None:
    src = _source_tree(tmp_path / "src")
    out = tmp_path / "wheels"
    # --no-build-isolation: setuptools is already installed, and the tests reach no index.
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    (wheel,) = out.glob("ckptd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"ckptd/py.typed", "ckpt/py.typed"} <= names, sorted(n for n in names if "typed" in n)
    # the packages themselves are there (the marker is not all it carries)
    assert {"ckpt/__init__.py", "ckpt/integrations/dcp.py", "ckptd/cli/ckptctl.py"} <= names
    assert "ckptd/cli/ctl/cmd_gc.py" in names  # ckptctl's commands, a subpackage
