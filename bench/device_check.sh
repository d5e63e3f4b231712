#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, build zerokern against the torch
# there, run the CUDA and Triton tests, the headline benchmarks and (time
# left) a compute-sanitizer pass over zerokern's CUDA kernels, and leave logs
# and JSON in OUTDIR.
#
#   bench/device_check.sh OUTDIR             # on the GPU machine
#   bench/device_check.sh --dry-run OUTDIR   # on a CPU: the same stages, CPU-sized, to check the script
#   bench/device_check.sh --all OUTDIR       # also the rest of the tests (CI runs them on CPUs)
#
# Budget: the GPU machine allows 10 minutes a command and 15 in all, start-up
# included, so everything here finishes within BUDGET seconds (default 480)
# from the start: each stage runs under its own limit, cut to what is left of
# the budget, and a stage that no longer fits is skipped with a line saying so.
# Estimates on an H200 (16 cores), in order of value:
#   build (nvcc, 16 jobs)            ~100 s   limit 180
#   GPU tests (CUDA + Triton JIT)     ~80 s   limit 150
#   adam_throughput 1M-1B params      ~60 s   limit  90
#   flatten_throughput (GPT-2 list)   ~15 s   limit  35
#   zero_step 1e7-1e9 params          ~25 s   limit  35
#   compute-sanitizer (optional)      what is left, at least 30 s
# The limits of the required stages add up to 450 s.
#
# Needs torch (CUDA), triton, nvcc, ninja, pytest, tqdm and matplotlib already
# installed: it downloads nothing (pip runs with --no-index). pytest-xdist and
# pytest-timeout are used when present. Each benchmark appends one JSON line
# per finished case to OUTDIR/<name>.jsonl, so a stage cut off at its limit
# keeps what it measured. summary.log holds every stage's whole output.
set -uo pipefail
dry=0 all=0
while [ $# -gt 1 ]; do
  case $1 in
    --dry-run) dry=1 ;;
    --all) all=1 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
out=${1:?usage: bench/device_check.sh [--dry-run] [--all] OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
py=${PYTHON:-python3}
budget=${BUDGET:-480}
log="$out/summary.log"
tmp=$(mktemp)
status=0
results=()

say() { echo "$*" | tee -a "$log"; }
left() { echo $((budget - SECONDS)); }
stage() {  # stage NAME LIMIT CMD...: under min(LIMIT, budget left); whole output to the log, its end to stdout
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  local rest; rest=$(left)
  if [ "$rest" -lt 15 ]; then
    local line="$name: skipped, ${rest} s of the ${budget} s budget left"
    say "== $line"; results+=("$line"); status=1; return
  fi
  [ "$limit" -gt "$rest" ] && limit=$rest
  echo "== $name (limit $limit s)" >> "$log"
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
  [ "$dry" = 1 ] && echo "dry run on the CPU: CPU-sized stages; the timings say nothing about a GPU"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  $py -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version 2>/dev/null | tail -1
  echo "cpus: $(nproc), budget ${budget} s"
} 2>&1 | tee "$log"

# Build in place against the installed torch (no isolation, no index); if pip
# cannot do an editable install here, build the extensions in the tree.
cuda=$([ "$dry" = 1 ] && echo "${ZEROKERN_CUDA:-0}" || echo 1)
build() {
  ZEROKERN_CUDA=$cuda MAX_JOBS=$(nproc) $py -m pip install -v --no-index --no-build-isolation --no-deps -e . \
    || { echo "pip failed; setup.py build_ext --inplace"; ZEROKERN_CUDA=$cuda MAX_JOBS=$(nproc) $py setup.py build_ext --inplace; }
}
export -f build 2>/dev/null
# Only this GPU's architecture (half the nvcc work of the default "8.0;9.0+PTX").
if [ "$dry" = 0 ] && [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  export TORCH_CUDA_ARCH_LIST=$($py -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo "9.0")
fi
export py cuda
stage "build" 180 bash -c build
cp "$tmp" "$out/build.log" 2>/dev/null
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the tree, built in place either way
$py -c "import zerokern; print('backends:', zerokern.available_backends()); print('unavailable:', zerokern.unavailable_backends())" 2>&1 | tee -a "$log"

par=(); $py -c "import xdist" 2>/dev/null && par=(-n 8)
per=(); $py -c "import pytest_timeout" 2>/dev/null && per=(--timeout 100)
if [ "$dry" = 1 ]; then
  dev=(--device cpu); adam=(--quick); flat=(--quick); zs=(--sizes 1e5,1e6 --rounds 3)
else
  dev=(); adam=(--budget 0.3); flat=(--budget 0.5); zs=(--sizes 1e7,1e8,1e9)
fi
# 1. What CI cannot run: the CUDA and Triton tests (on a CPU: the Triton interpreter's).
# A test module the GPU's torch cannot import (an older torch than CI's) must not stop the rest.
stage "gpu tests" 150 $py -m pytest -q -rs -p no:cacheprovider --continue-on-collection-errors -m "cuda or triton" "${par[@]}" "${per[@]}" tests
# 1b. End to end on the GPU, one process: zerokern's stage 2 (bf16 params, fp32 masters) beside
# torch.optim.AdamW on the same model and batches; the last loss lines of each.
gpt=(--steps 40 --log-every 10 --dtype bf16 --zero-stage 2 --weight-decay 0.01)
[ "$dry" = 1 ] && gpt=(--steps 5 --log-every 1 --zero-stage 2) || gpt+=(--device cuda)
export gpt_args="${gpt[*]}"
stage "train_gpt zerokern vs torch" 60 bash -c 'gpt=($gpt_args); '"$py"' examples/train_gpt.py "${gpt[@]}" --optimizer zerokern && '"$py"' examples/train_gpt.py "${gpt[@]}" --optimizer torch'
# 2. The headline benchmarks (GPU defaults: Adam 1M to 1B params; flatten: the GPT-2 list).
stage "adam_throughput" 90 $py bench/adam_throughput.py "${dev[@]}" "${adam[@]}" --jsonl "$out/adam_throughput.jsonl" \
  --json "$out/adam_throughput.json" --plot "$out/adam_throughput.png"
stage "flatten_throughput" 35 $py bench/flatten_throughput.py "${dev[@]}" "${flat[@]}" \
  --jsonl "$out/flatten_throughput.jsonl" --json "$out/flatten_throughput.json"
stage "zero_step" 35 $py bench/zero_step.py "${dev[@]}" "${zs[@]}" --jsonl "$out/zero_step.jsonl" --json "$out/zero_step.json"
stage "self_check_cost" 40 $py bench/self_check_cost.py "${dev[@]}" --rounds 21 --fresh 1 --json "$out/self_check_cost.json"
# 3. Optional, with what is left: out-of-bounds accesses in zerokern's CUDA kernels only (they live in
# namespace zerokern; torch's kernels are not instrumented), every tensor its own allocation.
if [ "$dry" = 1 ]; then
  say "compute-sanitizer: dry run, skipped"
elif ! command -v compute-sanitizer > /dev/null; then
  say "compute-sanitizer: not on PATH, skipped"
elif [ "$(left)" -lt 30 ]; then
  say "compute-sanitizer: $(left) s left of the budget, skipped"
else
  sanitize() {
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --kernel-name kns=zerokern \
      --error-exitcode 3 $py tests/kernels/cuda_sanitize.py > "$tmp.san" 2>&1
    local rc=$?
    cat "$tmp.san"
    # A sandboxed runtime may refuse the tool; that is not a finding about the kernels.
    if grep -q -i -E "device not supported|unable to (find|load)|not supported on this" "$tmp.san"; then
      echo "compute-sanitizer refused by this device/runtime: skipped, not a kernel error"; return 0
    fi
    return $rc
  }
  export -f sanitize; export tmp
  rest=$(left); stage "compute-sanitizer" $((rest - 5)) bash -c sanitize
fi
# 4. With --all, the rest of the suite (CI runs it on CPUs; here with a GPU visible).
if [ "$all" = 1 ]; then
  stage "other tests" 600 $py -m pytest -q -rs -p no:cacheprovider -m "not (cuda or triton)" "${par[@]}" "${per[@]}" tests
fi

rm -f "$tmp" "$tmp.san"
say "== device_check summary ($SECONDS s of the ${budget} s budget)"
for r in "${results[@]}"; do say "  $r"; done
exit $status
