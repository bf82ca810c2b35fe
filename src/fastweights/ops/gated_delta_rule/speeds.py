"""Measured times of ``gated_delta_rule`` per backend on each kind of GPU, milliseconds (median): what the
automatic choice ranks fla against this project's kernels by (ops/backend.py ``ranked``;
docs/gpu.md, "Which backend runs what"). Keys: the device kind (``backend.device_kind``), then
"forward" (no gradients) and "train" (forward and backward) by backend; "shape" and "source" say
what was measured where. Written by ``fastweights bench speeds`` from a record of
``fastweights bench gpu`` (its ops rows); a backend without a figure keeps its place in the
fixed order.
"""

SPEEDS = {
    'sm_90': {
        'shape': 'B8 T2048 H16 D128 bfloat16',
        'source': 'docs/gpu.md, "What the first GPU run found": NVIDIA H200, torch 2.11+cu130, Triton 3.6, fla 0.6',
        'forward': {'triton': 3.1},
    },
}
