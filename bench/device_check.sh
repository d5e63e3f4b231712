#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, build zerokern against the torch
# there, run every test (the CUDA and Triton ones included) and the benchmarks,
# and leave logs and JSON in OUTDIR. About 5 minutes on an H200.
#
#   bench/device_check.sh OUTDIR
#
# Needs torch (CUDA), triton, nvcc, ninja, pytest, hypothesis, tqdm and
# matplotlib already installed: it downloads nothing.
set -uo pipefail
out=${1:?usage: bench/device_check.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $py -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

# Build in place against the installed torch (no isolation, no dependencies fetched).
ZEROKERN_CUDA=1 MAX_JOBS=16 $py -m pip install -v --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 \
  || { echo "build failed"; tail -30 "$out/build.log"; exit 1; }
grep -E "^zerokern:" "$out/build.log"

$py -m pytest -q -rs tests -x --junitxml="$out/tests.xml" 2>&1 | tee "$out/tests.log" | tail -15 || status=1

for b in bench/adam_throughput.py bench/flatten_throughput.py; do
  name=$(basename "$b" .py)
  $py "$b" --budget 0.5 --json "$out/$name.json" --plot "$out/$name.png" 2>&1 | tee "$out/$name.log" | grep -v "it/s\|case/s" || status=1
done
$py bench/zero_step.py --sizes 1e7,1e8,1e9 --json "$out/zero_step.json" 2>&1 | tee "$out/zero_step.log" | grep -v "it/s" || status=1
exit $status
