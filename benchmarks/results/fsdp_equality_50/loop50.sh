#!/bin/bash
# 50 consecutive runs of the FSDP equality tests (issue 45): run from a checkout (or a worktree
# frozen at one commit, as the record was); the log names the commit, the CPU and the load.
#   benchmarks/results/fsdp_equality_50/loop50.sh [LOG]
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)" || exit 1
log=${1:-loop50.log}
: > "$log"
echo "commit $(git rev-parse --short HEAD)" >> "$log"
lscpu | grep "Model name" >> "$log"
nproc >> "$log"
echo "start $(date -Is) load: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$log"
pass=0; fail=0; t0=$(date +%s)
for i in $(seq 1 50); do
  s=$(date +%s)
  out=$(PYTHONPATH=$PWD/src python -m pytest -q -n 0 -p no:randomly -p no:cacheprovider \
        tests/train/test_fsdp_training.py -k "equals or carry" 2>&1)
  rc=$?
  last=$(echo "$out" | tail -1)
  if [ $rc -eq 0 ]; then pass=$((pass+1)); else fail=$((fail+1)); echo "$out" > "$log.fail-$i.txt"; fi
  echo "run $i rc=$rc $(( $(date +%s) - s ))s load=$(cut -d' ' -f1-3 /proc/loadavg) :: $last" >> "$log"
done
echo "end $(date -Is) passed=$pass failed=$fail total=$(( $(date +%s) - t0 ))s" >> "$log"
