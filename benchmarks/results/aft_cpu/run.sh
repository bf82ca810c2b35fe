#!/bin/bash
# Four rounds, each one process on the source before the change, then one on the source after.
# BEFORE and AFTER: src folders (git archive b0fb4c8 src | tar -x -C BEFORE; the same at HEAD).
for r in 1 2 3 4; do
  for v in before after; do
    P=$BEFORE; [ $v = after ] && P=$AFTER
    OMP_NUM_THREADS=1 PYTHONPATH=$P python "$(dirname "$0")/ab_ops.py" > $v$r.json
  done
done
