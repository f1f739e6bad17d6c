"""Operator namespace of this kernel build (the kernels hub convention).

The namespace carries the build id so that two builds loaded in one process
never register ops under the same name.
"""

import torch

NAMESPACE = "_m3_sparse_cuda_96958274d7"

ops = getattr(torch.ops, NAMESPACE)


def add_op_namespace_prefix(op_name: str) -> str:
    """Prefix an op name with this build's namespace (``torch.library`` style)."""
    return f"{NAMESPACE}::{op_name}"
