import os

import torch

# Triton kernels run on CPU tensors under the interpreter where no GPU is
# visible. Must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each test process takes one thread unless OMP_NUM_THREADS says otherwise (as
# the rank processes do, tests/dist_harness.py): two processes each running a pool as wide as the
# machine oversubscribe it. The tests of thread counts set theirs explicitly.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
