#!/usr/bin/env bash
# One GPU-machine session for dmuon-kernels: probe quack, run tests/gpu, then the SYRK, NS,
# cuBLAS block-count and optimizer-step benchmarks, each step time-boxed so one hang cannot eat
# the session. Everything lands in $OUT (or ./gpu-session-out): logs, the benchmark JSONs and the
# autotune verdict file.
#
#   source .gpu/setup.sh && bash benchmarks/gpu_kernels_session.sh [probe|tests|syrk|ns|blocks|step ...]
#
# With no arguments every step runs. Expects the checkout root as working directory.
set -u
OUT=${OUT:-$PWD/gpu-session-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/packages/dmuon-kernels/src:$PWD/packages/dmuon-core/src:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
export DMUON_CACHE_DIR=${DMUON_CACHE_DIR:-$(mktemp -d)}
steps=${*:-probe tests syrk ns}
sha=${DMUON_GIT_SHA:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}

for step in $steps; do
  start=$(date +%s)
  case $step in
    probe)
      nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
      timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/probe.log"
import time, torch
t = time.time(); import quack, cutlass; print(f"import quack {quack.__version__}: {time.time()-t:.1f}s")
from dmuon_kernels.syrk import quack as q, backend_availability
print("quack availability:", backend_availability("quack"))
A = torch.randn(512, 1024, device="cuda", dtype=torch.float16)
for label, X in [("k-major", A), ("m-major", A.T.contiguous().T)]:
    t = time.time(); out = q.syrk(X, None, 1.0, 0.0); torch.cuda.synchronize()
    print(f"first quack syrk {label}: {time.time()-t:.1f}s, err vs cublas "
          f"{((out.float()-(X.float()@X.float().T)).norm()/(X.float()@X.float().T).norm()).item():.2e}")
PY
      ;;
    tests)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    syrk)
      timeout ${SYRK_TIMEOUT:-240} python3 benchmarks/kernels/bench_syrk.py --out "$OUT/syrk.json" --git-sha "$sha" 2>&1 | tee "$OUT/syrk.log" | grep -v "SYRK autotune" ;;
    ns)
      timeout ${NS_TIMEOUT:-300} python3 benchmarks/kernels/bench_ns.py --out "$OUT/ns.json" --git-sha "$sha" 2>&1 | tee "$OUT/ns.log" | grep -v "SYRK autotune" ;;
    blocks)
      timeout ${BLOCKS_TIMEOUT:-150} python3 benchmarks/kernels/bench_cublas_blocks.py --out "$OUT/blocks.json" --git-sha "$sha" 2>&1 | tee "$OUT/blocks.log" ;;
    step)
      timeout ${STEP_TIMEOUT:-240} python3 benchmarks/step/bench_step.py --out "$OUT/step.json" --git-sha "$sha" 2>&1 | grep -v "SYRK autotune" | tee "$OUT/step.log" ;;
  esac
  echo "== step $step took $(( $(date +%s) - start ))s"
done
cp "$DMUON_CACHE_DIR"/syrk-autotune-*.json "$OUT/" 2>/dev/null || true
