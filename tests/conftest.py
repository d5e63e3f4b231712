import os
import sys

import torch

# The tests sit in folders by the wing they test (tests/README.md) and import the shared helpers here
# and their worker modules, and other folders' ones, by bare name: every folder goes on sys.path. The
# rank processes start with this sys.path (dist_harness hands it to them), so they find them too.
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _dir, _subdirs, _files in os.walk(_TESTS):
    _subdirs[:] = sorted(d for d in _subdirs if d not in ("__pycache__", "scripts", "cpp"))
    if _dir not in sys.path:
        sys.path.append(_dir)

# Triton kernels run on CPU tensors under the interpreter where no GPU is
# visible. Must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each test process takes one thread unless OMP_NUM_THREADS says otherwise (as
# the rank processes do, tests/dist_harness.py): two processes each running a pool as wide as the
# machine oversubscribe it. The tests of thread counts set theirs explicitly.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
