#!/usr/bin/env bash
# One device call on a GPU machine: the GPU tests, then the benchmarks against their anchors.
#
# Contract. The device tool runs it once, from the repository root, with a 590 s limit:
#     OUT=$OUT bash benchmarks/gpu_check.sh
# (by hand: `bash benchmarks/gpu_check.sh`, results only in the results directory). Nothing is
# installed: python3 (torch with CUDA, numpy, psutil, nvidia-ml-py, matplotlib, pytest) imports
# the packages from the checkout through PYTHONPATH. The script ends within TOTAL_S seconds
# (default 540) and exits 0; what each section did is in sections.txt.
#
# Sections, most wanted first (a call cut short loses the least): tests (`pytest -m gpu`),
# budget-h2048, step-h2048, pipeline-h4096, budget-h4096, step-h4096, info, profile, hooks.
# A section starts only if its expected duration (EXPECT_S below, an H200 estimate) fits in
# what is left of TOTAL_S less 15 s (for packing); the benchmarks write their results at the end, so
# one cut off would return nothing. It runs under `timeout` at min(its cap, what is left), so
# an overrun or a hang still leaves the later packing its time. A section skipped says so in
# sections.txt, with its estimate and the seconds that were left.
#
# Produces, in RESULTS_DIR (default benchmarks/results/gpu; earlier files there are left, and
# not returned): hardware.txt (GPU, driver, PCIe link, CPU, memory, the disk of NVME_DIR),
# sections.txt, gpu_tests.txt, each benchmark's <stem>.json / <stem>.md and its .log,
# info.json (stdout of `offload info --json`: pure JSON; its stderr in info.err), profile/ and
# profile.txt, hooks.json / hooks.md. With OUT set, after every section, at most 8 files in
# $OUT (the device tool returns no more):
#     gpu-results.tgz   every file this call wrote in RESULTS_DIR
#     hardware.txt  sections.txt  gpu_tests.txt  budget-h2048.md  step-h2048.md
#     pipeline-h4096.md  h4096.md (budget-h4096.md then step-h4096.md)
#
# Environment: TOTAL_S (seconds for the whole script, default 540); PARTS (comma list of
# sections, a name's prefix or suffix selecting several: `budget`, `h4096`; default all);
# NVME_DIR (the disk the NVMe tier and the disk probes use, default /tmp); PROBE_BYTES (size of
# the disk probes and of `offload info`'s copies, default 512MiB: one repeat each);
# RESULTS_DIR. A CPU dry run of the logic (the GPU tests are not started, 180 s being
# expected, and `offload info` runs):
#     TOTAL_S=100 PARTS=tests,info OUT=/tmp/o RESULTS_DIR=/tmp/r bash benchmarks/gpu_check.sh
set -uo pipefail
total="${TOTAL_S:-540}"
reserve=15  # `timeout -k 10`'s grace and the last packing
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="$(command -v python3 || command -v python)"
res="${RESULTS_DIR:-benchmarks/results/gpu}"
nvme="${NVME_DIR:-/tmp}"
probe="${PROBE_BYTES:-512MiB}"
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"; fi

# Expected seconds on one H200 (start to results written), and the cap each runs under.
# Derived from the work each does, since no GPU run has been timed yet (gpu_tests.txt keeps
# pytest's --durations and every benchmark log its elapsed seconds per round, to correct these
# from the first run). Every Python process pays about 10 s to import torch and start CUDA;
# GPT weights are drawn on the CPU (h2048 0.47 G parameters, about 3 s; h4096 0.94 G, 6 s);
# pinned host memory costs 0.4 s/GiB (offload/cli/_node_report.py, measured on an H200 host). Steps are
# short: h2048 and h4096 are 12 and 23 TFLOP a step, 20-40 ms at the 790 TFLOP/s bf16 measured
# on these machines; each saves about 3.5 GB (40 bytes per token, layer and unit of width,
# plus the bf16 logits and their float32 copy), about 70 ms each way over PCIe at 50 GB/s.
#   tests: about 40 cases (tests/test_gpu_*.py, the gpu-marked probe and storage tests, and
#     those being added): collection 15 s, the 21 small bitwise cases about 1 s each, the
#     CUDA-sanitizer subprocess 40-60 s (its own limit is 150 s), the budget tests 10 s each
#     (4 GiB saved, 8 steps), the rest a few seconds each: about 180 s.
#   budget-*: 2 anchor warm-up rounds x 3 variants, a profile, 3 plans, 3 managers x 3 warm-up
#     steps (each a first min-memory step with its own 3.5 GB pool, 1.5 s), 5 timed rounds x 6
#     variants: about 50 steps at 0.05-0.3 s, 25 s, plus start-up and weights: 60 s (h4096 70).
#   step-*: 7 rounds x 5 variants; the NVMe variant writes and reads 3.5 GB a step, 3 s at an
#     assumed 2 GB/s (unknown disk), 21 s in all; save_on_cpu's and the pool's first pinning
#     3 s; disk probes 4 x 512 MiB each way (1 repeat) 3 s; about 60 s, 75 with a slower disk.
#   pipeline-h4096: 7 rounds x 4 schedules of 8 microbatches (each 0.6 s of compute; the
#     offloaded one moves about 43 GB each way, 2 s), 4.4 s a round, 31 s; pinning 27 + 14 GB
#     of pools, 17 s; 5 profiled schedules and the prediction, 10 s: about 90 s, 100 allowed.
#   info 20 s (PCIe and disk probes of PROBE_BYTES); profile 30 s (4 layers, d 1024, 3 steps,
#     the plots); hooks 40 s (CPU tensors: 6 variants x 31 repeats of 2,000 saved tensors).
# The caps are about twice the estimate, the tests' 240 s.
declare -A EXPECT_S=([tests]=180 [budget-h2048]=60 [step-h2048]=75 [pipeline-h4096]=100
  [budget-h4096]=70 [step-h4096]=80 [info]=20 [profile]=30 [hooks]=40)
declare -A CAP_S=([tests]=240 [budget-h2048]=150 [step-h2048]=180 [pipeline-h4096]=240
  [budget-h4096]=150 [step-h4096]=180 [info]=60 [profile]=90 [hooks]=90)

mkdir -p "$res" && rm -f "$res/sections.txt"
# Files older than this stamp are an earlier run's (results committed, or a PARTS call before):
# they stay where they are but are not returned as this call's.
stamp="$(mktemp)"
touch -d "1 second ago" "$stamp"  # file times are coarser than a tick: equal is not newer
trap 'rm -f "$stamp"' EXIT
note() { echo "$*" >> "$res/sections.txt"; echo "gpu_check: $*"; }
note "gpu_check.sh at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%FT%TZ)," \
  "TOTAL_S=$total, PARTS=${PARTS:-all}, NVME_DIR=$nvme, PROBE_BYTES=$probe"
{  # time-limited too: a hung driver call here would take the whole call, with nothing packed
  timeout -k 5 30 nvidia-smi --format=csv --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max,pcie.link.gen.current,pcie.link.width.current
  timeout -k 5 60 "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  grep -m1 "model name" /proc/cpuinfo; echo "cores: $(nproc)"; free -g | head -n 2
  timeout -k 5 10 df -hT "$nvme"
} > "$res/hardware.txt" 2>&1

pack() {
  [ -n "${OUT:-}" ] || return 0
  # The device tool returns at most 8 files: one archive of this call's results, and seven.
  (cd "$res" && find . -type f -newer "$stamp" -print0 |
    tar czf "$OUT/gpu-results.tgz" --null -T -) 2>/dev/null
  local f h4096=()
  for f in hardware.txt sections.txt gpu_tests.txt budget-h2048.md step-h2048.md \
    pipeline-h4096.md; do
    fresh "$f" && cp "$res/$f" "$OUT/$f"
  done
  for f in budget-h4096.md step-h4096.md; do
    fresh "$f" && h4096+=("$res/$f")
  done
  (( ${#h4096[@]} )) && cat "${h4096[@]}" > "$OUT/h4096.md"
  return 0
}
fresh() { [ -f "$res/$1" ] && [ "$res/$1" -nt "$stamp" ]; }  # written by this call

selected() {  # NAME: in PARTS by its name, its prefix (budget) or its suffix (h4096)
  local parts=",${PARTS:-all},"
  [[ $parts == *",all,"* || $parts == *",$1,"* || $parts == *",${1%%-*},"* ||
    $parts == *",${1#*-},"* ]]
}

# section NAME STDOUT STDERR COMMAND...: runs COMMAND when NAME is selected and its expected
# duration fits in what is left, under timeout at min(its cap, what is left); STDERR empty:
# into STDOUT too. Notes the outcome and packs.
section() {
  local name="$1" out="$2" err="$3"
  shift 3
  selected "$name" || return 0
  local expect="${EXPECT_S[$name]}" cap="${CAP_S[$name]}" left=$(( total - SECONDS - reserve ))
  if (( left < expect )); then
    note "$name: skipped: expected ${expect} s, ${left} s left"
    return 0
  fi
  local lim=$(( cap < left ? cap : left )) rc=0 t0=$SECONDS
  # `timeout -k 10`: a process that ignores SIGTERM (a hung CUDA call) is killed 10 s later.
  if [ -n "$err" ]; then
    timeout -k 10 "$lim" "$@" > "$out" 2> "$err" || rc=$?
  else
    timeout -k 10 "$lim" "$@" > "$out" 2>&1 || rc=$?
  fi
  local why=""
  (( rc == 124 || rc == 137 )) && why=", stopped at its limit"
  note "$name: exit $rc$why, $(( SECONDS - t0 )) s (expected $expect, limit $lim)"
  tail -n 12 "$out"
  pack
}

pack
# Deterministic cuBLAS for the bitwise tests only (the benchmarks keep the default). A test
# running past 120 s gets every thread's traceback in the log (a hang shows where it waits).
section tests "$res/gpu_tests.txt" "" env CUBLAS_WORKSPACE_CONFIG=:4096:8 \
  "$py" -m pytest -v -m gpu tests -p no:cacheprovider -o faulthandler_timeout=120 --durations=15
bench() {  # bench NAME SCRIPT CONFIG [ARGS...]: benchmarks/SCRIPT --config CONFIG into $res
  local name="$1" script="$2" config="$3"
  shift 3
  section "$name" "$res/$name.log" "" "$py" "benchmarks/$script" --config "$config" \
    --out "$res" "$@"
}
# Planned mode at 25/50/75% of smallest-feasible..keep-all against no offload, checkpointing
# and offloading everything; then the step anchors with the NVMe tier and the raw limits.
bench budget-h2048 bench_budget.py h2048
bench step-h2048 bench_step.py h2048 --nvme-dir "$nvme" --io-repeats 1 --disk-max-bytes "$probe"
# Stage 0 of a 4-stage 1F1B pipeline, 8 microbatches: kept vs offloaded vs budgeted vs GPipe.
bench pipeline-h4096 bench_pipeline.py h4096
bench budget-h4096 bench_budget.py h4096
bench step-h4096 bench_step.py h4096 --nvme-dir "$nvme" --io-repeats 1 --disk-max-bytes "$probe"
# stdout is the JSON alone: warnings and log lines go to stderr, kept apart in info.err.
section info "$res/info.json" "$res/info.err" \
  "$py" -m offload info --json --nvme-dir "$nvme" --probe-bytes "$probe"
section profile "$res/profile.txt" "" "$py" -m offload profile --quiet --steps 2 \
  --out "$res/profile" examples/train_gpt.py --layers 4 --d-model 1024 --heads 16 --seq 1024 \
  --batch 8
# Saved-tensor hook overhead: CPU tensors only, the host's CPU is all it measures.
section hooks "$res/hooks.log" "" "$py" benchmarks/bench_hooks.py --out "$res"
note "done in $SECONDS s"
pack
exit 0
