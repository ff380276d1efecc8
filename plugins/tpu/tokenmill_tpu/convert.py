"""torch <-> numpy <-> jax, for the tensors that cross the plugin seam.

The core speaks torch; this plugin computes in JAX. On the host the conversion is a view
through numpy; bfloat16, which numpy lacks, travels as its bit pattern (int16) and is
reinterpreted as `ml_dtypes.bfloat16`, the type jax itself uses.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

_BF16 = np.dtype(ml_dtypes.bfloat16)
_TORCH_TO_NUMPY = {
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: _BF16,
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.int16: np.dtype(np.int16),
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}
_NUMPY_TO_TORCH = {v: k for k, v in _TORCH_TO_NUMPY.items()}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy (ml_dtypes) dtype of a torch dtype; ValueError naming an unsupported one."""
    if dtype not in _TORCH_TO_NUMPY:
        raise ValueError(f"dtype {dtype} has no numpy/jax counterpart here; use one of "
                         f"{sorted(str(d) for d in _TORCH_TO_NUMPY)}")
    return _TORCH_TO_NUMPY[dtype]


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A host numpy view (a copy if `tensor` is not on the CPU or not contiguous)."""
    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16)
    numpy_dtype(t.dtype)
    return t.numpy()


def to_torch(array: object) -> torch.Tensor:
    """A torch CPU tensor holding a copy of a numpy or jax array."""
    host = np.array(array)  # a writable copy: torch.from_numpy keeps a view
    if host.dtype == _BF16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    if host.dtype not in _NUMPY_TO_TORCH:
        raise ValueError(f"array dtype {host.dtype} has no torch counterpart here")
    return torch.from_numpy(host)
