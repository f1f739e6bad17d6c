"""Without a GPU, Triton kernels run only in Triton's interpreter, which is picked when
a kernel is decorated: choose it before any test module imports the kernel package."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
