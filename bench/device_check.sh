#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, build zerokern against the torch
# there, run the CUDA and Triton tests, the benchmarks, a compute-sanitizer
# pass over the CUDA kernels and then the rest of the tests, and leave logs and
# JSON in OUTDIR. Sized for about 8 minutes on an H200 (16 cores).
#
#   bench/device_check.sh OUTDIR
#
# Needs torch (CUDA), triton, nvcc, ninja, pytest, hypothesis, tqdm and
# matplotlib already installed: it downloads nothing. pytest-xdist and
# pytest-timeout are used when present. Writes 7 files (the device tool brings
# back 8 at most): summary.log (every stage's whole output, in order),
# build.log, and the benchmarks' JSON and PNG. Stages run most important
# first, each under its own time limit, and a failing stage does not stop the
# next, so one run shows everything that is wrong.
set -uo pipefail
out=${1:?usage: bench/device_check.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log="$out/summary.log"
tmp=$(mktemp)
status=0
results=()

say() { echo "$*" | tee -a "$log"; }
stage() {  # stage NAME SECONDS CMD...: run under a time limit; whole output to the log, its end to stdout
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name" >> "$log"
  timeout --kill-after=10 "$limit" "$@" > "$tmp" 2>&1
  rc=$?
  tr '\r' '\n' < "$tmp" | grep -v -E "it/s\]|s/it\]" >> "$log"
  echo "== $name"; tr '\r' '\n' < "$tmp" | grep -v -E "it/s\]|s/it\]|^ *$" | tail -n 12
  local why=""
  [ "$rc" = 124 ] && why=" (stopped at its $limit s limit)"
  [ "$rc" = 137 ] && why=" (killed: out of memory, or it ignored the stop at $limit s)"
  local line="$name: rc=$rc in $((SECONDS - t0)) s$why"
  say "== $line"
  results+=("$line")
  [ "$rc" = 0 ] || status=1
}

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $py -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1
  echo "cpus: $(nproc)"
} 2>&1 | tee "$log"

# Build in place against the installed torch (no isolation, nothing fetched);
# if pip cannot do an editable install here, build the extensions in the tree.
t0=$SECONDS
if ZEROKERN_CUDA=1 MAX_JOBS=$(nproc) $py -m pip install -v --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1; then
  say "build: pip editable install, $((SECONDS - t0)) s"
elif ZEROKERN_CUDA=1 MAX_JOBS=$(nproc) $py setup.py build_ext --inplace >> "$out/build.log" 2>&1; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  say "build: pip failed, setup.py build_ext --inplace worked, $((SECONDS - t0)) s"
else
  say "build failed after $((SECONDS - t0)) s"
  tail -40 "$out/build.log" | tee -a "$log"
  exit 1
fi
grep -m1 -E "zerokern: building" "$out/build.log" | tee -a "$log"
$py -c "import zerokern; print('backends:', zerokern.available_backends()); print('unavailable:', zerokern.unavailable_backends())" 2>&1 | tee -a "$log"

par=(); $py -c "import xdist" 2>/dev/null && par=(-n 8)
per=(); $py -c "import pytest_timeout" 2>/dev/null && per=(--timeout 240)
# 1. What CI cannot run: the CUDA and Triton tests.
stage "gpu tests" 200 $py -m pytest -q -rs -p no:cacheprovider -m "cuda or triton" "${par[@]}" "${per[@]}" tests
# 2. The benchmarks, GPU defaults (Adam: 1M to 1B params).
stage "adam_throughput" 120 $py bench/adam_throughput.py --budget 0.3 \
  --json "$out/adam_throughput.json" --plot "$out/adam_throughput.png"
stage "flatten_throughput" 45 $py bench/flatten_throughput.py --budget 0.5 \
  --json "$out/flatten_throughput.json" --plot "$out/flatten_throughput.png"
stage "zero_step" 45 $py bench/zero_step.py --sizes 1e7,1e8,1e9 --json "$out/zero_step.json"
# 3. Out-of-bounds accesses in the CUDA kernels (every tensor its own allocation).
if command -v compute-sanitizer > /dev/null; then
  stage "compute-sanitizer" 90 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
    --error-exitcode 3 $py tests/cuda_sanitize.py
else
  say "compute-sanitizer: not on PATH, skipped"
fi
# 4. The rest of the suite (CI runs it too; here with a GPU visible).
stage "other tests" 120 $py -m pytest -q -rs -p no:cacheprovider -m "not (cuda or triton)" "${par[@]}" "${per[@]}" tests

rm -f "$tmp"
say "== device_check summary"
for r in "${results[@]}"; do say "  $r"; done
exit $status
