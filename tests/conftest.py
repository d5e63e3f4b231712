import os

import torch

# Triton kernels run on CPU tensors under the interpreter where no GPU is
# visible. Must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
