#!/usr/bin/env bash
# One call on a GPU machine: the GPU tests, then every benchmark. Run from the repository root,
# with nothing installed (the packages are imported from the checkout):
#     bash benchmarks/gpu_check.sh                 # results in benchmarks/results/gpu/
#     OUT=/some/dir bash benchmarks/gpu_check.sh   # the device tool: also a .tgz of everything
#                                                  # and the Markdown tables in $OUT
# Everything takes longer than one 10-minute device call: pick sections with PARTS (comma
# separated; default all): tests, step, budget, pipeline, info, profile, hooks. For example
#     PARTS=tests,budget OUT=... bash benchmarks/gpu_check.sh      then      PARTS=step,pipeline ...
# Sections run most wanted first, so that a call cut short by TOTAL_S loses the least: the GPU
# tests; the benchmarks against their anchors, one configuration at a time (step and budget at
# h2048, pipeline at h4096, then step and budget at h4096); offload info and profile; last
# bench_hooks, whose CPU tensors measure the host alone.
# Each section has its own time limit, cut to what is left of TOTAL_S (default 480 s) for the
# whole script: a section that would start with under 30 s left is skipped (said in
# skipped.txt), so the script ends inside one device call. With OUT set, the results are packed
# into $OUT after every section: a call stopped at its limit still returns what finished.
# NVME_DIR picks the disk.
set -uo pipefail
part() { [[ ",${PARTS:-all}," == *",all,"* || ",${PARTS:-all}," == *",$1,"* ]]; }
total="${TOTAL_S:-480}"
# limit NAME SECONDS: prints the section's limit (SECONDS, or less: what is left of TOTAL_S less
# 15 s for packing); fails (and notes it) when under 30 s would be left.
limit() {
  local left=$(( total - SECONDS - 15 )) want="$2"
  if (( left < 30 )); then
    echo "$1: skipped, ${SECONDS} s of TOTAL_S=${total} used" >> "$res/skipped.txt"
    return 1
  fi
  echo $(( want < left ? want : left ))
}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="$(command -v python3 || command -v python)"
res="benchmarks/results/gpu"
mkdir -p "$res" && rm -f "$res/skipped.txt"
nvme="${NVME_DIR:-/tmp}"
{  # time-limited too: a hung driver call here would take the whole call, with nothing packed
  timeout -k 5 30 nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  timeout -k 5 60 "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  timeout -k 5 10 df -hT "$nvme"
} > "$res/hardware.txt" 2>&1
pack() {
  [ -n "${OUT:-}" ] || return 0
  # The device tool returns at most 8 files: one archive of everything, and the tables.
  tar czf "$OUT/gpu-results.tgz" -C "$res" . 2>/dev/null
  cp "$res/gpu_tests.txt" "$res/hardware.txt" "$OUT/" 2>/dev/null  # skipped.txt: in the .tgz
  cp "$res"/hooks.md "$res"/step-h2048.md "$res"/step-h4096.md "$OUT/" 2>/dev/null
  cat "$res"/budget-h2048.md "$res"/budget-h4096.md > "$OUT/budget.md" 2>/dev/null
  cp "$res"/pipeline-h4096.md "$OUT/" 2>/dev/null
  return 0
}
pack
# `timeout -k 10`: a process that ignores SIGTERM (a hung CUDA call) is killed 10 s later.
if part tests && lim=$(limit tests 360); then
  # Deterministic cuBLAS for the bitwise tests only (the benchmarks keep the default). A test
  # running past 120 s gets every thread's traceback in the log (a hang shows where it waits).
  CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout -k 10 "$lim" "$py" -m pytest -q -m gpu tests \
    -p no:cacheprovider -o faulthandler_timeout=120 > "$res/gpu_tests.txt" 2>&1
  tail -n 15 "$res/gpu_tests.txt"
  pack
fi
# The benchmarks against their anchors, one configuration at a time (see the top).
run_step() {  # no offload, checkpoint every block, save_on_cpu, offload to cpu and to nvme
  part step && lim=$(limit "step-$1" 600) || return 0
  timeout -k 10 "$lim" "$py" benchmarks/bench_step.py --config "$1" --nvme-dir "$nvme" \
    --out "$res" > "$res/step-$1.log" 2>&1
  tail -n 25 "$res/step-$1.log"
  pack
}
run_budget() {  # the planned mode at 25/50/75% of no offload's peak (about a minute each)
  part budget && lim=$(limit "budget-$1" 240) || return 0
  timeout -k 10 "$lim" "$py" benchmarks/bench_budget.py --config "$1" --out "$res" \
    > "$res/budget-$1.log" 2>&1
  tail -n 8 "$res/budget-$1.log"
  pack
}
# Stage 0 of a 4-stage 1F1B pipeline, 8 microbatches: kept vs offloaded vs GPipe order, and the
# simulator's prediction (about a minute; seconds per offloaded schedule).
run_pipeline() {
  part pipeline && lim=$(limit pipeline 300) || return 0
  timeout -k 10 "$lim" "$py" benchmarks/bench_pipeline.py --config h4096 --out "$res" \
    > "$res/pipeline-h4096.log" 2>&1
  tail -n 30 "$res/pipeline-h4096.log"
  pack
}
run_step h2048
run_budget h2048
run_pipeline
run_step h4096
run_budget h4096
if part info && lim=$(limit info 120); then
  timeout -k 10 "$lim" "$py" -m offload info --json --nvme-dir "$nvme" --probe-bytes 1GiB \
    > "$res/info.json" 2>&1
  pack
fi
if part profile && lim=$(limit profile 180); then
  timeout -k 10 "$lim" "$py" -m offload profile --quiet --steps 2 --out "$res/profile" \
    examples/train_gpt.py --layers 4 --d-model 1024 --heads 16 --seq 1024 --batch 8 \
    > "$res/profile.txt" 2>&1
  pack
fi
# Saved-tensor hook overhead: CPU tensors only, the host's CPU is all it measures.
if part hooks && lim=$(limit hooks 120); then
  timeout -k 10 "$lim" "$py" benchmarks/bench_hooks.py --out "$res" > "$res/hooks.log" 2>&1
  pack
fi
pack
[ -f "$res/skipped.txt" ] && cat "$res/skipped.txt"
exit 0
