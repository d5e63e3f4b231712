#!/usr/bin/env bash
# A GPT whose training state does not fit in the memory a job is allowed, trained with the state on
# disk: 2 ranks (torchrun, gloo), bf16 params, stage 2, in a memory cgroup of LIMIT bytes.
#   sudo bench/nvme_memory_limit.sh OUTDIR [LIMIT_MB] [DISK_DIR]      (root: it makes a cgroup)
# Four runs of examples/train_gpt.py with the same model, data and seed:
#   1. in memory, no limit: the reference loss curve and the job's peak memory
#   2. state on disk (--offload nvme), no limit: its peak memory
#   3. in memory, under the limit: expected to be killed (the state does not fit)
#   4. state on disk, under the limit: trains; its losses must equal run 1's
# Memory: the cgroup's memory.max_usage_in_bytes (cgroup v1: RSS and page cache of every process of
# the job; page cache is reclaimed at the limit, so a run that fits can still touch it), and the
# job's peak anonymous memory (total_rss of memory.stat, polled); each run gets a fresh cgroup.
set -uo pipefail
out=${1:?usage: bench/nvme_memory_limit.sh OUTDIR [LIMIT_MB] [DISK_DIR]}
limit_mb=${2:-2048}
disk=${3:-/var/tmp/zerokern-nvme}
mkdir -p "$out" "$disk"
cg=/sys/fs/cgroup/memory
[ -d $cg ] || { echo "no cgroup v1 memory controller at $cg" >&2; exit 2; }
model=(--d-model 1024 --layers 8 --heads 16 --vocab 96 --ctx 64 --batch 4 --steps ${STEPS:-6} --log-every 1
       --dtype bf16 --zero-stage 2 --lr 1e-3 --weight-decay 0.01)
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

run() {  # run NAME LIMIT_BYTES ARGS...: torchrun inside a fresh cgroup; prints rc and peak
  local name=$1 lim=$2; shift 2
  local g=$cg/zerokern-$name-$$
  mkdir -p $g && echo "$lim" > $g/memory.limit_in_bytes
  (echo $BASHPID > $g/cgroup.procs; exec torchrun --nproc_per_node=2 --monitor-interval=1 examples/train_gpt.py \
     "${model[@]}" --log-json "$out/$name.json" "$@") > "$out/$name.log" 2>&1 &
  local job=$! rss=0 mapped=0 r m
  while kill -0 $job 2>/dev/null; do  # the job's anonymous memory (total_rss) and mapped files, polled
    r=$(awk '$1 == "total_rss" {print $2}' $g/memory.stat); m=$(awk '$1 == "total_mapped_file" {print $2}' $g/memory.stat)
    [ "${r:-0}" -gt $rss ] && rss=$r
    [ "${m:-0}" -gt $mapped ] && mapped=$m
    sleep 0.2
  done
  wait $job
  local rc=$?
  echo "$name: peak anonymous (RSS) $((rss / 1048576)) MB, peak mapped files $((mapped / 1048576)) MB (polled every 0.2 s)"
  local peak; peak=$(cat $g/memory.max_usage_in_bytes)
  local oom; oom=$(grep -h "oom_kill \|under_oom" $g/memory.oom_control 2>/dev/null | tr '\n' ' ')
  echo "$name: rc=$rc peak=$((peak / 1048576)) MB limit=$((lim / 1048576)) MB $oom"
  rmdir $g 2>/dev/null
  return 0
}
{
  echo "date: $(date -u +%FT%TZ); $(getconf _NPROCESSORS_ONLN) cpus; limit ${limit_mb} MB; disk dir $disk ($(df -T "$disk" | tail -1 | awk '{print $2}'))"
  run memory-unlimited 9223372036854771712
  run nvme-unlimited 9223372036854771712 --offload nvme --offload-path "$disk" --offload-chunk-mb 4
  run memory-limited $((limit_mb * 1048576))
  run nvme-limited $((limit_mb * 1048576)) --offload nvme --offload-path "$disk" --offload-chunk-mb 4
  python - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def losses(name):
    try:
        return json.load(open(f"{out}/{name}.json"))["losses"]
    except (OSError, ValueError):
        return None
ref, nv = losses("memory-unlimited"), losses("nvme-limited")
print("losses in memory, no limit:", ref)
print("losses on disk, limited:   ", nv)
print("the same losses:", ref is not None and ref == nv)
for name in ("memory-unlimited", "nvme-limited"):
    for line in open(f"{out}/{name}.log"):
        if "mem MB" in line:
            last = line.strip()
    print(name, "last step's memory_report (rank 0):", last.split("mem MB")[-1])
PY
} 2>&1 | tee "$out/summary.log"
