"""Random-sign Hadamard rotations along head_dim: R = diag(s) H / sqrt(D). Quantizing ``q R``
and ``k R`` (same R) leaves ``q k^T`` unchanged while spreading outlier channels over the whole
row, so FP8 rounds the product's terms more evenly (ptxattn.fp8.quantize's ``rotation``)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = ["hadamard_matrix", "HadamardRotation", "hadamard_rotation"]


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix, H[i, j] = (-1)^popcount(i & j), float64, unnormalised."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


class HadamardRotation(NamedTuple):
    """x -> (x * signs) H / sqrt(D) along the last axis: orthogonal, so it keeps q k^T."""

    signs: np.ndarray  # float32 (head_dim,), entries +-1

    @property
    def head_dim(self) -> int:
        return self.signs.shape[0]

    def matrix(self) -> np.ndarray:
        """The rotation as a float64 (D, D) matrix R, applied as x @ R."""
        return self.signs[:, None].astype(np.float64) * hadamard_matrix(self.head_dim) / math.sqrt(
            self.head_dim)


def hadamard_rotation(head_dim: int, seed: int | None = None) -> HadamardRotation:
    """A random-sign Hadamard rotation of size head_dim (a power of two)."""
    hadamard_matrix(head_dim)
    signs = np.random.default_rng(seed).choice(np.array([-1.0, 1.0], np.float32), head_dim)
    return HadamardRotation(signs.astype(np.float32))
