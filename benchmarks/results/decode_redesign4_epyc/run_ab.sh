#!/bin/bash
# Interleaved A/B of `fastweights bench decode`: the tree before Redesign IV (made with
# `git archive b0fb4c8 src | tar -x -C /tmp/redesign_base`) against this one.
cd "$(dirname "$0")/../../.."
for i in 1 2 3; do
  for side in base new; do
    if [ $side = base ]; then SRC=/tmp/redesign_base/src; else SRC=$PWD/src; fi
    OMP_NUM_THREADS=1 PYTHONPATH=$SRC python -m fastweights bench decode \
      --mixers delta softmax ttt-linear gated-delta norm infini linear aft-simple \
      --contexts 1024 --new-tokens 64 --out /tmp/ab_${side}_$i.json > /tmp/ab_${side}_$i.txt 2>&1
  done
done
