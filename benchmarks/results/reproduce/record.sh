#!/usr/bin/env bash
# Record reproductions one after another (issue 35): for each NAME SEEDS pair, run
#   python -m fastweights reproduce NAME --seeds SEEDS --out runs/reproduce/NAME
# with one thread under nice, timed by /usr/bin/time -v (CPU time, peak memory: the log), then copy
# the record's files (reproduce.json, results.csv, windows.csv, PNGs) into
# benchmarks/results/reproduce/NAME and render it there (results.md, and README.md from its
# README.in.md). A rerun continues an interrupted reproduction from its finished runs.
#
#   nohup nice -n 10 benchmarks/results/reproduce/record.sh fwp-lm 0,1,2,3,4,5 long-context 0,1,2,3 &
#
# NAME@MODEL|MODEL... runs only those models' runs of SEEDS into the same folder (more seeds for
# the models of a claim near its margin; driver.reproduce(models=...)), e.g.
#   record.sh 'infini-passkey@infini (linear)|infini (linear), memory off' 4,5
#
# Run it from the repository root; logs go to runs/reproduce/NAME.log.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p runs/reproduce
while [ $# -ge 2 ]; do
  spec=$1 seeds=$2
  shift 2
  name=${spec%%@*}
  log=runs/reproduce/$name.log
  echo "== $spec seeds $seeds: start $(date -Is), $(lscpu | grep 'Model name' | tr -s ' ')" >> "$log"
  if [ "$spec" = "$name" ]; then
    /usr/bin/time -v python -m fastweights reproduce "$name" --seeds "$seeds" \
        --out "runs/reproduce/$name" --quiet >> "$log" 2>&1
  else
    /usr/bin/time -v python -c 'import sys
from pathlib import Path
from fastweights.reproduce.driver import reproduce
name, models = sys.argv[1].split("@", 1)
reproduce(name, Path("runs/reproduce") / name, [int(s) for s in sys.argv[2].split(",")],
          models=models.split("|"), progress=False)' "$spec" "$seeds" >> "$log" 2>&1
  fi
  rc=$?
  echo "== $name: exit $rc at $(date -Is)" >> "$log"
  if [ $rc -eq 0 ]; then
    dest=benchmarks/results/reproduce/$name
    mkdir -p "$dest"
    rm -f "$dest"/*.png
    cp runs/reproduce/"$name"/{reproduce.json,results.csv,results.md} "$dest"/
    cp runs/reproduce/"$name"/windows.csv runs/reproduce/"$name"/*.png "$dest"/ 2>/dev/null || true
    # the record is its rendering (results.md, and README.md from README.in.md): tests/reproduce/test_records.py
    python -m fastweights reproduce "$name" --render --out "$dest" --quiet >> "$log" 2>&1
  fi
done
