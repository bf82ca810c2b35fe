#!/bin/bash
# One device call: environment, bench gpu (no fla), the TTT profile. Args: BUDGET_S [extra bench args]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
B=${1:-300}; shift
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv 2>&1 | tee $OUT/env.txt
python3 -c "import torch,triton,platform;print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__,'python',platform.python_version())" 2>&1 | tee -a $OUT/env.txt
python3 -m fastweights bench gpu --no-fla --budget-s $B --out $OUT/gpu "$@" 2>&1 | grep -v USDT | tail -60
cat $OUT/gpu/results.md | head -150
