"""RCCL collectives through torch.distributed (a ROCm build of torch names RCCL's backend
"nccl"); gloo in interpreter mode (CPU tensors), so conformance tier T1 runs every
collective in real multi-process groups either way."""

from __future__ import annotations

from tokenmill.platforms.interfaces import Communicator
from tokenmill_triton.distributed import make_communicator as _make

GPU_BACKENDS = frozenset({"nccl"})  # RCCL
INTERPRETER_BACKENDS = frozenset({"gloo"})


def make_communicator(group: object | None, interpreter: bool) -> Communicator:
    return _make(group, INTERPRETER_BACKENDS if interpreter else GPU_BACKENDS, "rocm")
