"""How the transformers integration calls the kernel's ops: through ``api`` when it runs
eagerly, through the ops' custom ops while ``torch.compile`` traces, and on the input's GPU."""

from __future__ import annotations

import functools

import torch

from .. import api, custom_ops


def on_input_device(fn):
    """Run ``fn(module, x, ...)`` with ``x``'s GPU as the current CUDA device: Triton launches
    on the current device, and with a ``device_map`` a layer may sit on another GPU."""

    @functools.wraps(fn)
    def wrapper(module, x, *args, **kwargs):
        # A compiled step runs on one device (generate() does not compile across devices).
        if not torch.compiler.is_compiling() and x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return fn(module, x, *args, **kwargs)
        return fn(module, x, *args, **kwargs)

    return wrapper


def call_op(name: str, **kwargs):
    """``api.<name>(**kwargs)``; while ``torch.compile`` traces, the same call as the op's
    custom op, which the graph keeps as one node (the op's checks and launch logic run
    when the graph runs, never while tracing)."""
    if torch.compiler.is_compiling():
        return custom_ops.call(name, **kwargs)
    return getattr(api, name)(**kwargs)
