"""Session setup shared by all tests.

Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates a function, and triton decorates
its own library functions (tl.sum, ...) when it is first imported, so the CPU interpreter that
tests/ops/test_fwp_triton.py runs the kernels with must be chosen before any import of triton.
Nothing else in the test suite runs Triton code (torch.compile on CPU generates C++), so the
setting affects that module only; an explicit TRITON_INTERPRET in the environment wins.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's test command runs one worker per core), each worker gets one
# intra-op thread: two workers with two threads each on a 2-core machine would oversubscribe it.
# Set before torch is imported by any test module; an explicit OMP_NUM_THREADS wins.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
