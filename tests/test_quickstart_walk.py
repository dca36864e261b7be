"""docs/quickstart.md runs as written, in order, as a new user would follow it (and so
does the README's one-process example, examples/corruption_walkthrough.py).

Its python blocks run one after another in one fresh interpreter (one namespace, like a
script pasted together), then each `ckptctl` line of its shell blocks runs through the
real console script. Only what a reader must supply is supplied: the training step the
doc leaves to them (`train_one_step`, here a small change of the weights), and a scratch
directory in place of /tmp/ckpts. The install commands (section 1) and the torchrun line
(section 4, which names the reader's own script) are not run; every other command must
exit 0. A doc whose sections disagree (a step its commands name that its loop retired, a
later section resuming a job an earlier one saved with another state) fails here.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from coordinator_fixtures import BIN, REPO, child_env

pytestmark = pytest.mark.timeout(300)
DOC = (REPO / "docs" / "quickstart.md").read_text()
DOC_ROOT = "/tmp/ckpts"

# What the doc leaves to the reader: one training step, which changes the weights so
# that the saves differ (`ckptctl diff` then has something to show).
READER = """
def train_one_step():
    with torch.no_grad():
        model.weight.add_(1e-3)
"""


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, re.S)


def ckptctl_lines() -> list[list[str]]:
    """Each `ckptctl ...` line of the shell blocks, its comment dropped, split as a shell
    would split it."""
    out = []
    for block in blocks("sh"):
        for line in block.splitlines():
            if line.startswith("ckptctl "):
                out.append(shlex.split(line, comments=True))
    return out


def test_the_doc_has_what_this_walk_runs() -> None:
    python = blocks("python")
    assert len(python) >= 2 and any("Checkpointer" in b for b in python)
    assert "def train_one_step" not in DOC  # else READER would shadow the doc's own
    commands = {argv[1] for argv in ckptctl_lines()}
    assert {"list", "inspect", "verify", "diff", "restore", "gc"} <= commands


def test_quickstart_runs_as_written(tmp_path) -> None:
    root = tmp_path / "ckpts"
    script = "\n".join(blocks("python")).replace(DOC_ROOT, str(root))
    # The reader's train_one_step goes in before the loop that calls it, after the model
    # it changes exists (the first block).
    at = script.index("\ncp = ckpt.Checkpointer(")
    program = script[:at] + "\n" + READER + script[at:]
    run = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env(),
        cwd=tmp_path,
    )
    assert run.returncode == 0, f"the quickstart's python failed:\n{run.stdout}{run.stderr}"

    for argv in ckptctl_lines():
        argv = [a.replace(DOC_ROOT, str(root)) for a in argv]
        p = subprocess.run(
            [str(BIN / "ckptctl"), *argv[1:]],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(),
            cwd=tmp_path,
        )
        assert p.returncode == 0, (
            f"`{shlex.join(argv)}` exited {p.returncode}:\n{p.stdout}{p.stderr}"
        )
        assert "error" not in (p.stdout + p.stderr).lower(), (
            f"`{shlex.join(argv)}`:\n{p.stdout}{p.stderr}"
        )
    # restore wrote the file its line names, where the reader stands
    assert (tmp_path / "model.safetensors").stat().st_size > 0


def test_the_corruption_walkthrough_runs_as_the_readme_says(tmp_path) -> None:
    """examples/corruption_walkthrough.py, which the README lists: every line of its
    summary says yes (its exit status says so too)."""
    p = subprocess.run(
        [sys.executable, str(REPO / "examples" / "corruption_walkthrough.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env(),
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    summary = p.stdout[p.stdout.index("== Summary") :].splitlines()[1:]
    assert len(summary) == 5 and all(line.endswith(" yes") for line in summary), summary
