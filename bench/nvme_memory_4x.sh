#!/usr/bin/env bash
# A GPT whose optimizer state is at least 4x the memory its job is allowed, trained on 2 ranks
# (torchrun, gloo, CPU) at stage 3 with the state, the fp32 masters and the param shards on disk:
#   sudo bench/nvme_memory_4x.sh OUTDIR [LIMIT_MB] [DISK_DIR]      (root: it makes a memory cgroup)
# The model is built on the meta device and materialised block by block (--meta-init), so no rank
# ever holds it whole. Two runs of examples/train_gpt.py in a fresh cgroup of LIMIT_MB each:
#   1. in memory (stage 3, state in RAM): expected to be killed, the state does not fit
#   2. on disk (--offload nvme --offload-params): trains
# Memory: the cgroup's memory.max_usage_in_bytes (RSS and page cache of the job; page cache is
# reclaimed at the limit), the job's peak anonymous memory (total_rss of memory.stat) and mapped
# files, polled every 0.2 s, and each rank's memory_report (rank 0 logs it). D_MODEL and LAYERS set
# the model (12 * D_MODEL^2 params per block), STEPS the steps.
set -uo pipefail
out=${1:?usage: bench/nvme_memory_4x.sh OUTDIR [LIMIT_MB] [DISK_DIR]}
limit_mb=${2:-4096}
disk=${3:-/var/tmp/zerokern-nvme}
mkdir -p "$out" "$disk"
cg=/sys/fs/cgroup/memory
[ -d $cg ] || { echo "no cgroup v1 memory controller at $cg" >&2; exit 2; }
model=(--d-model ${D_MODEL:-2048} --layers ${LAYERS:-30} --heads ${HEADS:-16} --vocab 96 --ctx 16 --batch 2
       --steps ${STEPS:-3} --log-every 1 --dtype bf16 --zero-stage 3 --meta-init --lr 1e-3 --weight-decay 0.01
       --bucket-cap-mb 64)
# glibc raises its mmap threshold (to 32 MB) after the first large free, and then keeps freed buffers
# below it on its heap: ~200 MB a rank here (measured with /proc/self/status). A fixed threshold
# returns them; both runs get it.
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MALLOC_MMAP_THRESHOLD_=131072

run() {  # run NAME LIMIT_BYTES ARGS...: torchrun inside a fresh cgroup; prints rc and peaks
  local name=$1 lim=$2; shift 2
  local g=$cg/zerokern-$name-$$
  mkdir -p $g && echo "$lim" > $g/memory.limit_in_bytes
  local t0=$SECONDS
  (echo $BASHPID > $g/cgroup.procs; exec torchrun --nproc_per_node=2 --monitor-interval=1 examples/train_gpt.py \
     "${model[@]}" --log-json "$out/$name.json" "$@") > "$out/$name.log" 2>&1 &
  local job=$! rss=0 mapped=0 r m
  while kill -0 $job 2>/dev/null; do
    r=$(awk '$1 == "total_rss" {print $2}' $g/memory.stat); m=$(awk '$1 == "total_mapped_file" {print $2}' $g/memory.stat)
    [ "${r:-0}" -gt $rss ] && rss=$r
    [ "${m:-0}" -gt $mapped ] && mapped=$m
    sleep 0.2
  done
  wait $job
  local rc=$?
  local peak; peak=$(cat $g/memory.max_usage_in_bytes)
  local oom; oom=$(grep -h "oom_kill \|under_oom" $g/memory.oom_control 2>/dev/null | tr '\n' ' ')
  echo "$name: rc=$rc in $((SECONDS - t0)) s; cgroup peak $((peak / 1048576)) MB of the $((lim / 1048576)) MB limit; $oom"
  echo "$name: peak anonymous (RSS) $((rss / 1048576)) MB, peak mapped files $((mapped / 1048576)) MB (polled every 0.2 s)"
  rmdir $g 2>/dev/null
  return 0
}
{
  echo "date: $(date -u +%FT%TZ); $(getconf _NPROCESSORS_ONLN) cpus; limit ${limit_mb} MB; disk dir $disk ($(df -T "$disk" | tail -1 | awk '{print $2}')); model ${model[*]}"
  run memory-limited $((limit_mb * 1048576))
  run nvme-limited $((limit_mb * 1048576)) --offload nvme --offload-path "$disk" --offload-params --offload-chunk-mb 4
  python - "$out" "$limit_mb" <<'PY'
import json, re, sys
out, limit_mb = sys.argv[1], float(sys.argv[2])
for name in ("memory-limited", "nvme-limited"):
    try:
        print(name, "losses:", json.load(open(f"{out}/{name}.json"))["losses"])
    except (OSError, ValueError, KeyError):
        print(name, "losses: none (the job did not finish)")
rep = None
for line in open(f"{out}/nvme-limited.log"):
    if "mem MB" in line:
        rep = dict((k, float(v)) for k, v in re.findall(r"(\w+)=([\d.]+)", line.split("mem MB")[-1]))
    if "params:" in line or "parameters" in line:
        print(line.strip())
if rep:
    print("nvme-limited last step's memory_report (rank 0, MB):", rep)
    state_mb = rep["on_disk"] * 12 / 14 * 2  # m, v, master of both ranks (on_disk: 12 + 2 bytes a param per rank)
    print(f"optimizer state (m, v, fp32 master; both ranks): {state_mb:,.0f} MB = {state_mb / limit_mb:.2f}x the limit")
PY
} 2>&1 | tee "$out/summary.log"
