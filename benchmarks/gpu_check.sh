#!/usr/bin/env bash
# One call on a GPU machine: the GPU tests, then every benchmark. Run from the repository root,
# with nothing installed (the packages are imported from the checkout):
#     bash benchmarks/gpu_check.sh                 # results in benchmarks/results/gpu/
#     OUT=/some/dir bash benchmarks/gpu_check.sh   # the device tool: also a .tgz of everything
#                                                  # and the Markdown tables in $OUT
# Everything takes longer than one 10-minute device call: pick sections with PARTS (comma
# separated; default all): tests, hooks, info, profile, step, budget, pipeline. For example
#     PARTS=tests,budget OUT=... bash benchmarks/gpu_check.sh      then      PARTS=step,pipeline ...
# Each section has its own time limit. NVME_DIR picks the disk.
set -uo pipefail
part() { [[ ",${PARTS:-all}," == *",all,"* || ",${PARTS:-all}," == *",$1,"* ]]; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="$(command -v python3 || command -v python)"
res="benchmarks/results/gpu"
mkdir -p "$res"
nvme="${NVME_DIR:-/tmp}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  df -hT "$nvme"
} > "$res/hardware.txt" 2>&1
if part tests; then
  # Deterministic cuBLAS for the bitwise tests only (the benchmarks keep the default).
  CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 500 "$py" -m pytest -q -m gpu tests -p no:cacheprovider > "$res/gpu_tests.txt" 2>&1
  tail -n 15 "$res/gpu_tests.txt"
fi
part hooks && timeout 300 "$py" benchmarks/bench_hooks.py --out "$res" > /dev/null 2>&1
part info && timeout 120 "$py" -m offload info --json --nvme-dir "$nvme" --probe-bytes 1GiB \
  > "$res/info.json" 2>&1
part profile && timeout 300 "$py" -m offload profile --quiet --steps 2 --out "$res/profile" \
  examples/train_gpt.py --layers 4 --d-model 1024 --heads 16 --seq 1024 --batch 8 \
  > "$res/profile.txt" 2>&1
part step && for cfg in h2048 h4096; do
  timeout 600 "$py" benchmarks/bench_step.py --config "$cfg" --nvme-dir "$nvme" --out "$res" \
    > "$res/step-$cfg.log" 2>&1
  tail -n 25 "$res/step-$cfg.log"
done
# The planned mode at 25/50/75% of no offload's peak against its anchors (about a minute each).
part budget && for cfg in h2048 h4096; do
  timeout 240 "$py" benchmarks/bench_budget.py --config "$cfg" --out "$res" \
    > "$res/budget-$cfg.log" 2>&1
  tail -n 8 "$res/budget-$cfg.log"
done
# Stage 0 of a 4-stage 1F1B pipeline, 8 microbatches: kept vs offloaded vs GPipe order, and the
# simulator's prediction (about a minute; seconds per offloaded schedule).
if part pipeline; then
  timeout 300 "$py" benchmarks/bench_pipeline.py --config h4096 --out "$res" \
    > "$res/pipeline-h4096.log" 2>&1
  tail -n 30 "$res/pipeline-h4096.log"
fi
if [ -n "${OUT:-}" ]; then
  # The device tool returns at most 8 files: one archive of everything, and the tables.
  tar czf "$OUT/gpu-results.tgz" -C "$res" .
  cp "$res/gpu_tests.txt" "$res/hardware.txt" "$OUT/" 2>/dev/null
  cp "$res"/hooks.md "$res"/step-h2048.md "$res"/step-h4096.md "$OUT/" 2>/dev/null
  cat "$res"/budget-h2048.md "$res"/budget-h4096.md > "$OUT/budget.md" 2>/dev/null
  cp "$res"/pipeline-h4096.md "$OUT/" 2>/dev/null
fi
