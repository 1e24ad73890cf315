"""Tensor-parallel building blocks. Pure torch: nothing here imports Ray."""
from service.parallel.group import ParallelGroup
from service.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelAttention,
)

__all__ = [
    "ParallelGroup",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelAttention",
]
