#!/bin/bash
# Device call 2 (see benchmarks/results/gpu_h200/README.md).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>&1 | tee $OUT/env.txt
python3 -c "import torch,triton,platform;print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__,'python',platform.python_version())" 2>&1 | tee -a $OUT/env.txt
fw() { d=$1; shift; python3 -m fastweights bench gpu --no-fla ${DRY:+--dry-run} --out $OUT/$d "$@" 2>&1 | grep -v USDT | tail -4; echo "=== $d"; sed -n '/^## /,$p' $OUT/$d/results.md | grep -v "^$" | cut -c1-240; (cd $OUT && tar rf all.tar $d && rm -rf $d); }
fw exact --budget-s 35 --sections exact --ops ttt_mlp
FASTWEIGHTS_TTT_FWD=regs fw regs --budget-s 35 --sections exact,layers --ops ttt_linear --mixers ttt-linear --repeats 5
python3 .gpu/profile_layers.py $OUT/prof.json 4096 ttt-linear ttt-mlp 2>&1 | grep -v USDT > $OUT/prof.log; grep "^==" $OUT/prof.log; (cd $OUT && tar rf all.tar prof.json && rm prof.json)
timeout 40 python3 .gpu/decode_check.py ${DRY:+cpu} 2>&1 | grep -v USDT | tee $OUT/decode.log | tail -12
fw layers --budget-s 60 --sections layers --mixers ttt-linear,ttt-mlp,aft-local,aft-simple,aft-conv,gated-delta,fla-delta,retnet
fw train --budget-s 45 --sections train --mixers linear,dpfp,favor,delta,infini,norm,diag,aft-local,aft-simple,aft-conv,ttt-linear,ttt-mlp,gated-delta,fla-delta,retnet --repeats 5
