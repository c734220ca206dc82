#!/usr/bin/env bash
# One call on a GPU machine: the GPU tests, then every benchmark, results into $OUT (or
# benchmarks/results/gpu). Run from the repository root:
#     bash benchmarks/gpu_check.sh
set -uo pipefail
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$out/hardware.txt" 2>&1
python -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.txt"
python benchmarks/bench_hooks.py --out "$out" 2>&1 | tail -n 20
python -m offload info --json --nvme-dir "${NVME_DIR:-/tmp}" --probe-bytes 1GiB > "$out/info.json" 2>&1
python -m offload profile --steps 2 --out "$out/profile" examples/train_gpt.py --layers 4 --d-model 1024 --heads 16 --seq 1024 --batch 8 > "$out/profile.txt" 2>&1
for cfg in h2048 h4096; do
  python benchmarks/bench_step.py --config "$cfg" --nvme-dir "${NVME_DIR:-/tmp}" --out "$out" 2>&1 | tee "$out/step-$cfg.log" | tail -n 40
done
