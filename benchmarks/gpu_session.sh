#!/usr/bin/env bash
# One GPU session's measurements, in parts that each fit one device call (600 s), every step
# time-boxed so a hung one cannot take the rest down. Writes logs and JSON under $OUT; prints
# each step's exit status and the tail of its log.
#
#   part 0: the whole tests/gpu alone (the log to commit after a change to GPU code)
#   part 1: the whole tests/gpu (the logs to commit), the end-to-end step at world size 1 with
#           the low-memory state: bf16 momentum and masters offloaded to CPU (issue 26)
#   part 2: why the overlapped step is slower at world size 1 (issue 24: profile_overlap), the
#           optimizer step (issue 23: bench_step, bench_fused_step), the HF Trainer run
#   part 3: first steps on a fresh machine and warm (issue 27: bench_cold_start on Qwen2,
#           Qwen3-MoE and the 0.89 B Llama), NS schedules
#   part 4: host cost per call (bench_dispatch), gloo collectives (the simulator's calibration),
#           torchtitan (issue 21; needs a torch its release supports)
#   part 5: the whole tests/gpu, then the three models' first steps again (after a cold-start
#           change)
#   part 6: the whole tests/gpu, then the end-to-end step at world size 1, plain and overlapped
#           (after a change to the step)
#   part 7: the optimizer step by kernel class (bench_step --profile), and inside the FSDP2 run
#           against alone (profile_opt_step)
#   part 8: the whole tests/gpu, then the overlapped step against the plain one at world size 1,
#           paired (overlap_ab)
#   part 9: the overlapped step at world size 1: each one's step and peak memory (bench_e2e),
#           where each phase's host and device time goes (overlap_timeline), the kernels by
#           stream and name (profile_overlap)
#   part 10: the background compile's and float8's GPU tests, float8 with dedicated weights
#            (bench_float8, eager), the optimizer step by kernel class (bench_step --profile)
#   part 11: the whole tests/gpu, then the optimizer step by kernel class (bench_step --profile)
#   part 12: first steps on a fresh machine with the background compile (bench_cold_start), one
#            model per run so a time-out loses only the last
#   part 13: the GPU tests of the update epilogue and of the steps it changes, the optimizer step
#            by kernel class with the update written by the last product and written out
#            (bench_step --profile), the 0.89 B Llama's first steps (bench_cold_start)
#   part 14: what issue 44 still lacks a figure for: the 0.89 B Llama's iteration and optimizer
#            step against FSDP2 + AdamW at world size 1 (bench_e2e), float8 compiled on text
#            (bench_float8 --compile --data, the Shakespeare bytes carried in .gpu/)
#   part 15: the update epilogue's GPU tests (the direct form's a·I in place), the 0.89 B
#            Llama's iteration and optimizer step against FSDP2 + AdamW (bench_e2e), the
#            optimizer step by kernel class with its Chrome trace and host profile (bench_step)
#   part 16: the update GEMM's and the epilogue's GPU tests, the update GEMM against cuBLAS and
#            a copy (bench_update_gemm), the optimizer step by kernel class (bench_step)
#   part 17: float8 compiled on text alone (bench_float8 --compile --data; its compiles take
#            most of a call), on the corpus' first 1.7 MB of training text (829 windows of 2048
#            for the 800 the run takes), which keeps the carried files under a call's 64 MiB
#   part 19: the 0.89 B Llama's optimizer step by kernel class, inside FSDP2 and alone
#            (profile_opt_step), with its Chrome trace
#   part 18: the whole tests/gpu, then the 0.89 B Llama's iteration against FSDP2 + AdamW
#            (bench_e2e, 20 steps)
#
# Usage, on the GPU machine from the repository root with .gpu/ carried along:
#   bash benchmarks/gpu_session.sh <part> <git-sha>
set -uo pipefail
part=$1
sha=$2
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
source .gpu/setup.sh
src=$PWD/packages
export PYTHONPATH=$src/dmuon-kernels/src:$src/dmuon-core/src:$src/dmuon-hf/src:$src/dmuon-tools/src:$src/dmuon-titan/src:${PYTHONPATH:-}

step() {  # step <name> <seconds> <command...>
  local name=$1 limit=$2
  shift 2
  local began=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local status=$?
  echo "== $name: exit $status after $((SECONDS - began)) s"
  tail -n 12 "$out/$name.log"
}

# The whole tests/gpu in <shards> pytest processes at once, each over a contiguous slice of the
# collected tests (a kernel's cases stay together, so each shard compiles it once): the suite is
# mostly single-threaded CPU work (kernel compilation, host dispatch) and the machine has 16 cores.
# One log, gpu-tests.log, the shards' logs one after the other (a device call returns few files).
sharded_gpu_tests() {  # sharded_gpu_tests <shards> <seconds>
  local shards=$1 limit=$2 began=$SECONDS pids=() i
  python -m pytest tests/gpu -q -p no:cacheprovider --collect-only 2>/dev/null \
    | grep '::' >"$out/gpu-test-ids.txt"
  local total
  total=$(wc -l <"$out/gpu-test-ids.txt")
  for ((i = 0; i < shards; i++)); do
    awk -v lo=$((i * total / shards)) -v hi=$(((i + 1) * total / shards)) \
      'NR > lo && NR <= hi' "$out/gpu-test-ids.txt" >"$out/gpu-test-ids-$i.txt"
    timeout "$limit" xargs -a "$out/gpu-test-ids-$i.txt" -d '\n' \
      python -m pytest -q -p no:cacheprovider >"$out/gpu-tests-$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < shards; i++)); do
    wait "${pids[$i]}"
    echo "== gpu-tests shard $i of $shards: exit $? after $((SECONDS - began)) s"
    tail -n 3 "$out/gpu-tests-$i.log"
  done
  for ((i = 0; i < shards; i++)); do
    echo "==== shard $i of $shards: $(head -n 1 "$out/gpu-test-ids-$i.txt") ..."
    cat "$out/gpu-tests-$i.log"
  done >"$out/gpu-tests.log"
  rm -f "$out"/gpu-test-ids*.txt "$out"/gpu-tests-?.log
}

case $part in
0)
  # Three shards took 223 to over 342 s (2026-12-04); four at once were slower still (two past
  # 250 s): the machine's 16 cores compile for all of them.
  sharded_gpu_tests 3 385
  ;;
1)
  sharded_gpu_tests 3 380
  step e2e 180 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/e2e/bench_e2e.py --variants \
    fsdp2-adamw,dmuon-z3,dmuon-z3+offload,dmuon-z3+bf16m,dmuon-z3+bf16m+offload \
    --git-sha "$sha" --out "$out/e2e-w1.json"
  ;;
2)
  step profile-overlap 200 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/overlap/profile_overlap.py --git-sha "$sha" --out "$out/profile-overlap.json"
  step fused-step 60 python benchmarks/step/bench_fused_step.py --git-sha "$sha" --out "$out/fused-step.json"
  step step 100 python benchmarks/step/bench_step.py --git-sha "$sha" --out "$out/step.json"
  step hf-trainer 200 python benchmarks/checks/run_hf_trainer_cuda.py --out "$out/hf-trainer-w1.json"
  ;;
3)
  step cold-start-qwen 270 python benchmarks/e2e/bench_cold_start.py --models qwen2 qwen3-moe \
    --git-sha "$sha" --out "$out/cold-start-qwen.json"
  step cold-start-llama 200 python benchmarks/e2e/bench_cold_start.py --models llama-0.89b \
    --git-sha "$sha" --out "$out/cold-start-llama.json"
  step ns-schedules 90 python benchmarks/kernels/bench_ns_schedules.py --git-sha "$sha" \
    --out "$out/ns-schedules.json"
  ;;
4)
  step dispatch 100 python benchmarks/kernels/bench_dispatch.py --shapes 1024x4096 2048x2048 \
    4096x4096 8192x8192 --host-profile 20 --git-sha "$sha" --out "$out/dispatch.json"
  step collectives 150 python -m torch.distributed.run --standalone --nproc-per-node 4 \
    benchmarks/overlap/bench_collectives.py --backend gloo --iters 10 --warmup 2 --git-sha "$sha" \
    --out "$out/collectives-gloo-w4.json"
  # torchtitan and its small pure-Python dependencies travel as wheels in .gpu/titan.
  python -m pip install -q --no-deps --target /tmp/titan-site .gpu/titan/*.whl >/dev/null 2>&1
  PYTHONPATH=$PYTHONPATH:/tmp/titan-site GIT_SHA=$sha \
    step titan 150 python benchmarks/e2e/bench_titan.py --out "$out/titan-w1.json"
  ;;
5)
  sharded_gpu_tests 3 285
  step cold-start 290 python benchmarks/e2e/bench_cold_start.py --models qwen2 qwen3-moe llama-0.89b \
    --git-sha "$sha" --out "$out/cold-start.json"
  ;;
6)
  sharded_gpu_tests 3 380
  step e2e 200 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/e2e/bench_e2e.py --variants fsdp2-adamw,dmuon-z3,dmuon-z3-overlap \
    --git-sha "$sha" --out "$out/e2e-w1.json"
  ;;
7)
  step step 150 python benchmarks/step/bench_step.py --profile --git-sha "$sha" --out "$out/step.json"
  step opt-step 150 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/step/profile_opt_step.py --git-sha "$sha" --out "$out/profile-opt-step.json"
  ;;
8)
  sharded_gpu_tests 3 400
  step overlap-ab 150 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/overlap/overlap_ab.py --rounds 60 --git-sha "$sha" --out "$out/overlap-ab.json"
  ;;
9)
  step e2e 130 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/e2e/bench_e2e.py --variants dmuon-z3,dmuon-z3-overlap \
    --git-sha "$sha" --out "$out/e2e-w1.json"
  step overlap-timeline 100 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/overlap/overlap_timeline.py --git-sha "$sha" --out "$out/overlap-timeline.json"
  step profile-overlap 200 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/overlap/profile_overlap.py --git-sha "$sha" --out "$out/profile-overlap.json"
  ;;
10)
  step gpu-tests-new 200 python -m pytest -q -p no:cacheprovider \
    tests/gpu/test_background_compile_gpu.py tests/gpu/test_float8_gpu.py
  step float8 250 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/e2e/bench_float8.py --git-sha "$sha" --out "$out/float8.json"
  step step 130 python benchmarks/step/bench_step.py --profile --git-sha "$sha" --out "$out/step.json"
  ;;
11)
  # 300 s cut shard 0 (the background compile's runs, the cold-start tests) short (d3e1d61).
  sharded_gpu_tests 3 400
  step step 130 python benchmarks/step/bench_step.py --profile --git-sha "$sha" --out "$out/step.json"
  ;;
12)
  for model in qwen2 llama-0.89b qwen3-moe; do
    step "cold-start-$model" 200 python benchmarks/e2e/bench_cold_start.py --models "$model" \
      --steps 20 --git-sha "$sha" --out "$out/cold-start-$model.json"
  done
  ;;
13)
  step gpu-tests-epilogue 150 python -m pytest -q -p no:cacheprovider \
    tests/gpu/test_update_epilogue_gpu.py tests/gpu/test_overlap_gpu.py \
    tests/gpu/test_offload_gpu.py tests/gpu/test_float8_gpu.py tests/gpu/test_fused_gpu.py
  step step 100 python benchmarks/step/bench_step.py --profile --git-sha "$sha" --out "$out/step.json"
  step cold-start-llama-0.89b 300 python benchmarks/e2e/bench_cold_start.py --models llama-0.89b \
    --steps 20 --git-sha "$sha" --out "$out/cold-start-llama-0.89b.json"
  ;;
14)
  step e2e 200 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/e2e/bench_e2e.py --variants fsdp2-adamw,dmuon-z3 \
    --git-sha "$sha" --out "$out/e2e-w1.json"
  step float8-compiled 350 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/e2e/bench_float8.py --compile --data .gpu/shakespeare-bytes.npz \
    --git-sha "$sha" --out "$out/float8-compiled.json"
  ;;
15)
  step epilogue-tests 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_update_epilogue_gpu.py
  step e2e 200 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/e2e/bench_e2e.py --variants fsdp2-adamw,dmuon-z3 \
    --git-sha "$sha" --out "$out/e2e-w1.json"
  step step 150 python benchmarks/step/bench_step.py --profile "$out/step-trace.json.gz" \
    --host-profile --git-sha "$sha" --out "$out/step.json"
  ;;
16)
  step update-gemm-tests 260 python -m pytest -q -p no:cacheprovider tests/gpu/test_update_gemm_gpu.py \
    tests/gpu/test_update_epilogue_gpu.py tests/gpu/test_ns_graphs_gpu.py tests/gpu/test_fused_gpu.py \
    tests/gpu/test_overlap_gpu.py tests/gpu/test_syrk_gpu.py
  step update-gemm 240 python benchmarks/kernels/bench_update_gemm.py --git-sha "$sha" \
    --out "$out/update-gemm.json"
  step step 150 python benchmarks/step/bench_step.py --profile "$out/step-trace.json.gz" \
    --git-sha "$sha" --out "$out/step.json"
  ;;
17)
  step float8-compiled 560 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/e2e/bench_float8.py --compile --data .gpu/shakespeare-bytes-1.7m.npz \
    --git-sha "$sha" --out "$out/float8-compiled.json"
  ;;
18)
  sharded_gpu_tests 3 400
  step e2e 90 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/e2e/bench_e2e.py --variants fsdp2-adamw,dmuon-z3 --steps 20 \
    --git-sha "$sha" --out "$out/e2e-w1.json"
  ;;
19)
  step profile-opt-step 200 python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/step/profile_opt_step.py --trace "$out/opt-step-trace" --git-sha "$sha" \
    --out "$out/profile-opt-step.json"
  ;;
*)
  echo "part must be 0 to 19" >&2
  exit 2
  ;;
esac
