#!/usr/bin/env bash
# One step past toy scale (issue 44, docs/reproductions.md "One step past toy scale"): the claims
# of fwp-lm, ttt-ablation and aft that the 1x records leave smaller than claimed, without
# effect or inconclusive, trained 4x the steps with six seeds, each group of models one
# invocation within ~45 min of one core of an idle 2-core machine (estimates from the 1x
# records' CPU times: run time grows linearly with the steps). Each goes to runs/reproduce/NAME-4x
# (a rerun continues it), then benchmarks/results/reproduce/NAME-4x is copied and rendered.
#
#   nohup nice -n 10 benchmarks/results/reproduce/record_4x.sh [GROUP ...] &
#
# GROUP (default: all, one after another; logs in runs/reproduce/NAME-4x.log):
#   fwp-lm     softmax, linear (delta)                              ~18 min
#   ttt        b=1, b=4, 4 + Mamba backbone (b=16), b=64             ~42 min
#   aft-local  aft-full, aft-local s=4, s=32, s=64                   ~48 min
#   aft-conv   aft-conv, signed weights, no sigmoid(Q) gate, aft-simple ~27 min
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p runs/reproduce
SEEDS=0,1,2,3,4,5
declare -A NAME MODELS
NAME[fwp-lm]=fwp-lm;            MODELS[fwp-lm]='softmax|linear (delta)'
NAME[ttt]=ttt-ablation;         MODELS[ttt]='b=1|b=4|4 + Mamba backbone|b=64'
NAME[aft-local]=aft;            MODELS[aft-local]='aft-full|aft-local s=4|aft-local s=32|aft-local s=64'
NAME[aft-conv]=aft;             MODELS[aft-conv]='aft-conv|aft-conv, signed weights|aft-conv, no sigmoid(Q) gate|aft-simple'
for group in "${@:-fwp-lm ttt aft-local aft-conv}"; do
  for g in $group; do
    name=${NAME[$g]} out=runs/reproduce/${NAME[$g]}-4x
    log=$out.log
    echo "== $g ($name, 4x steps, seeds $SEEDS): start $(date -Is), $(lscpu | grep 'Model name' | tr -s ' ')" >> "$log"
    /usr/bin/time -v python -c 'import sys
from pathlib import Path
from fastweights.reproduce.driver import reproduce
name, out, models, seeds = sys.argv[1:5]
reproduce(name, Path(out), [int(s) for s in seeds.split(",")], models=models.split("|"),
          steps_factor=4, progress=False)' "$name" "$out" "${MODELS[$g]}" "$SEEDS" >> "$log" 2>&1
    rc=$?
    echo "== $g: exit $rc at $(date -Is)" >> "$log"
    if [ $rc -eq 0 ]; then
      dest=benchmarks/results/reproduce/$name-4x
      mkdir -p "$dest"
      cp "$out"/{reproduce.json,results.csv,results.md} "$dest"/
      cp "$out"/windows.csv "$out"/*.png "$dest"/ 2>/dev/null || true
      python -m fastweights reproduce "$name" --render --out "$dest" --quiet >> "$log" 2>&1
    fi
  done
done
