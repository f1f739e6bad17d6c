"""KV-outer sparse attention, one module per stage, each torch reference beside its kernels:
``build`` (index builder: who chose each block), ``schedule`` (balanced tile slices),
``partials`` (one softmax step per tile), ``combine`` (merge each row's partials)."""

from .build import KVOuterIndex, build_kvouter_index
from .combine import combine
from .partials import kvouter_partials
from .schedule import Schedule, schedule

__all__ = ["KVOuterIndex", "Schedule", "build_kvouter_index", "combine", "kvouter_partials", "schedule"]
