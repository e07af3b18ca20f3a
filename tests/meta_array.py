"""A stand-in with a CuPy array's metadata (shape, dtype, strides, data pointer, device) and no
contents, so argument validation, which reads only metadata, is tested without a GPU."""

import dataclasses

import ml_dtypes  # noqa: F401  makes "bfloat16" a NumPy dtype name
import numpy as np


@dataclasses.dataclass
class _Data:
    ptr: int


@dataclasses.dataclass
class _Device:
    id: int


class MetaArray:
    def __init__(self, shape, dtype="bfloat16", strides=None, ptr=1 << 20, device=0):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        if strides is None:
            strides, step = [], self.itemsize
            for n in reversed(self.shape):
                strides.insert(0, step)
                step *= n
        self.strides = tuple(strides)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape))
        self.data = _Data(ptr)
        self.device = _Device(device)
