#!/usr/bin/env bash
# The multi-GPU NCCL session, kept ready for the first machine with several GPUs: for each world
# size (default 2 4 8, those above the GPU count skipped) the protocol against the single-process
# reference (run_protocol_cuda.py: 1-D Z3/Z2 and 2 x (world/2) HSDP async/sync, bit-identity
# checks), the collective times the simulator's links assume (bench_collectives.py), and the
# end-to-end step of FSDP2 + AdamW, dmuon Z3/Z2 and naive Muon (bench_e2e.py), and the overlapped
# owner step against the plain one, paired (overlap_ab.py), each step time-boxed so one hang
# cannot eat the session. JSON and logs land in $OUT (default
# ./multi-gpu-out); commit the JSON under benchmarks/results/ and rerun
# `dmuon-tools calibrate --results benchmarks/results --markdown > docs/simulator-calibration.md`.
#
#   bash benchmarks/multi_gpu_session.sh [protocol|collectives|e2e|e2e-large|overlap ...]
#   WORLDS="8" bash benchmarks/multi_gpu_session.sh e2e
#
# With no arguments: protocol collectives e2e overlap. e2e-large runs bench_e2e with d_model 4096
# and 8 layers (about 3.6 B parameters: per-layer compute near Llama-3-8B's). Expects the checkout
# root as working directory and the packages importable (installed, or their sources on PYTHONPATH
# as the GPU machine's README says).
set -u
OUT=${OUT:-$PWD/multi-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export DMUON_CACHE_DIR=${DMUON_CACHE_DIR:-$(mktemp -d)}
export DMUON_SYRK_AUTOTUNE_LOG=${DMUON_SYRK_AUTOTUNE_LOG:-0}
steps=${*:-protocol collectives e2e overlap}
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
sha=${DMUON_GIT_SHA:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}
# Result names as the committed ones: <benchmark>-<gpu>-...-<date>.json ("NVIDIA H200" -> h200).
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
  | tr '[:upper:]' '[:lower:]' | sed -e 's/^nvidia //' -e 's/[^a-z0-9]\{1,\}/-/g' -e 's/-$//')
day=$(date -u +%Y-%m-%d)
status=0

run() {  # run <name> <timeout seconds> <world> <script> [args...]
  local name=$1 limit=$2 world=$3 script=$4
  shift 4
  local start=$(date +%s)
  timeout "$limit" python3 -m torch.distributed.run --standalone --nproc-per-node "$world" \
    "$script" --git-sha "$sha" "$@" 2>&1 | tee "$OUT/$name-w$world.log" | grep -v "SYRK autotune"
  local code=${PIPESTATUS[0]}
  echo "== $name at $world GPUs: exit $code, $(( $(date +%s) - start ))s"
  [ "$code" -eq 0 ] || status=1
}

for world in ${WORLDS:-2 4 8}; do
  if [ "$world" -gt "$gpus" ]; then
    echo "== skipping world size $world: $gpus GPUs here"
    continue
  fi
  for step in $steps; do
    case $step in
      protocol)
        run protocol "${PROTOCOL_TIMEOUT:-300}" "$world" benchmarks/checks/run_protocol_cuda.py \
          --backend nccl --out "$OUT/protocol-$device-nccl-w$world-$day.json" ;;
      collectives)
        run collectives "${COLLECTIVES_TIMEOUT:-300}" "$world" benchmarks/overlap/bench_collectives.py \
          --out "$OUT/collectives-$device-nccl-w$world-$day.json" ;;
      e2e)
        run e2e "${E2E_TIMEOUT:-600}" "$world" benchmarks/e2e/bench_e2e.py \
          --out "$OUT/e2e-$device-w$world-$day.json" ;;
      e2e-large)
        run e2e-large "${E2E_TIMEOUT:-600}" "$world" benchmarks/e2e/bench_e2e.py \
          --dim 4096 --layers 8 --out "$OUT/e2e-$device-d4096-w$world-$day.json" ;;
      overlap)
        run overlap "${OVERLAP_TIMEOUT:-600}" "$world" benchmarks/overlap/overlap_ab.py \
          --rounds 30 --out "$OUT/overlap-ab-$device-w$world-$day.json" ;;
      *)
        echo "unknown step $step (protocol, collectives, e2e, e2e-large, overlap)"; exit 2 ;;
    esac
  done
done
exit $status
