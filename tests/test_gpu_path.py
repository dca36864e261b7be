"""The CUDA path: pinned staging on a side stream, CUDA tensors through Checkpointer.save,
ckpt.load (into CUDA tensors and into {}) and resume, and bench/gpu.py end to end. Marked
`gpu` (deselected by default; run with -m gpu on a machine with CUDA, or bench/gpu_check.sh);
without CUDA the benchmark exits with its "no CUDA device" message, and bench/gpu_check.sh
runs through to it, which the unmarked tests check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt

ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_gpu_bench_without_cuda_exits_with_a_clear_message(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "no CUDA device" in out.stderr
    assert not list(tmp_path.iterdir())  # nothing was written


def test_gpu_check_script_runs_the_tests_then_the_bench(tmp_path):
    """bench/gpu_check.sh, the one script for a lent GPU machine, runs ckptd from the source
    tree: here, without CUDA, its gpu tests skip and the bench says it measured nothing."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    out = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path), "--dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr  # the bench's "no CUDA device"
    assert "available: False" in out.stdout
    assert "gpu tests rc=0, bench/gpu.py rc=2" in out.stdout
    assert "skipped" in (tmp_path / "gpu-tests.log").read_text()
    assert "no CUDA device" in (tmp_path / "gpu-bench.log").read_text()


@pytest.mark.gpu
@needs_cuda
def test_cuda_state_saves_and_loads_through_pinned_staging(job):
    state = {
        "w": torch.randn(1 << 20, device="cuda"),
        "b": torch.randn(33, device="cuda", dtype=torch.bfloat16),
        "cpu": torch.arange(10),
    }
    with ckpt.Checkpointer(job, verify="full") as cp:
        cp.resume(state, allow_fresh_start=True)  # maps and registers the staging image
        pending = cp.save(state, 1)
        saved_w = state["w"].clone()  # (x + 1) - 1 != x in fp32: compare with a copy
        state["w"].add_(1)  # training goes on: the staged copy is what gets saved
        pending.wait()
        assert cp._image._pinned
        dst = {k: torch.zeros_like(v) for k, v in state.items()}
        assert cp.resume(dst) == 1
    assert dst["w"].device.type == "cuda"
    assert torch.equal(dst["w"], saved_w)
    assert torch.equal(dst["b"], state["b"]) and torch.equal(dst["cpu"], state["cpu"])
    out = ckpt.load({}, job, step=1).state  # a load into {} makes CPU tensors
    assert torch.equal(out["w"], saved_w.cpu())


@pytest.mark.gpu
@needs_cuda
def test_gpu_bench_quick_run(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--quick", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode in (0, 1), out.stderr  # 1: a goal missed, still a full run
    assert "Traceback" not in out.stderr, out.stderr
    assert "results:" in out.stdout
