#!/usr/bin/env bash
# The GPU checks in one run, on a CUDA machine whose python already holds torch: the
# gpu-marked tests (pinned staging, CUDA tensors through save/load/resume, bench/gpu.py
# --quick), then bench/gpu.py at full size. ckptd runs from this source tree, not an
# install, so a machine with no package registry needs only ckptd's own dependencies
# (blake3, grpcio, protobuf, orjson, ...) importable beside its torch.
#
#   bench/gpu_check.sh [LOGDIR] [bench/gpu.py args...]
#
# Logs and the bench's JSON land in LOGDIR (default bench/results). The full bench is
# skipped when the tests failed (it would fail the same way; set GPU_BENCH_ANYWAY=1 to run
# it regardless). GPU_PYTEST_K selects tests (pytest -k; "not quick" leaves out the quick
# bench run, which the full one covers). Exit status: the tests' if they failed, else the
# bench's.
set -u
cd "$(dirname "$0")/.."
LOG=${1:-bench/results}
shift || true
mkdir -p "$LOG"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
df -h . | tail -1
$PY - <<'EOF' || exit 3
import blake3, grpc, google.protobuf, orjson, torch
import ckpt, ckptd.server.app  # ckptd from this tree, with every dependency it imports
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, available: "
      f"{torch.cuda.is_available()}), grpcio {grpc.__version__}, "
      f"protobuf {google.protobuf.__version__}, blake3 {blake3.__version__}")
EOF

timeout 180 $PY -m pytest -m gpu tests/test_gpu_path.py -p no:cacheprovider -q -rA \
    ${GPU_PYTEST_K:+-k "$GPU_PYTEST_K"} 2>&1 |
    tee "$LOG/gpu-tests.log"
tests=${PIPESTATUS[0]}
if [ "$tests" -ne 0 ] && [ -z "${GPU_BENCH_ANYWAY:-}" ]; then
    echo "gpu tests failed (rc=$tests): the full bench was not run"
    exit "$tests"
fi

# The bench's state plus two checkpoints and a DCP copy stand on the disk at once: keep
# the state within a fifth of the free space (10 GiB, the issue's size, where it fits).
free_gib=$(df -BG --output=avail . | tail -1 | tr -dc 0-9)
size=$(( free_gib / 5 < 10 ? free_gib / 5 : 10 ))
timeout 330 $PY bench/gpu.py --size-gib "$size" "$@" 2>&1 | tee "$LOG/gpu-bench.log"
bench=${PIPESTATUS[0]}
cp bench/results/gpu-*.json "$LOG"/ 2>/dev/null || true
echo "gpu tests rc=$tests, bench/gpu.py rc=$bench (size ${size} GiB, ${free_gib} GiB free)"
exit "$bench"
