"""Random-sign Hadamard rotations along head_dim: R = diag(s) H / sqrt(D). Quantizing ``q R``
and ``k R`` (same R) leaves ``q k^T`` unchanged while spreading outlier channels over the whole
row, so FP8 rounds the product's terms more evenly (ptxattn.fp8.quantize's ``rotation``).
ptxattn.fp8 re-exports ``hadamard_rotation`` and ``HadamardRotation``."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = ["hadamard_matrix", "HadamardRotation", "hadamard_rotation"]


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of size n: H[i, j] = (-1)^popcount(i & j), unnormalised.

    Parameters
    ----------
    n : int
        The size, a power of two.

    Returns
    -------
    numpy.ndarray
        float64 (n, n) of +-1 entries; H H^T = n I.

    Raises
    ------
    ValueError
        n not a power of two.

    Examples
    --------
    >>> hadamard_matrix(2)
    array([[ 1.,  1.],
           [ 1., -1.]])
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


class HadamardRotation(NamedTuple):
    """A random-sign Hadamard rotation R = diag(signs) H / sqrt(D) along head_dim.

    x -> (x * signs) H / sqrt(D) along the last axis: R is orthogonal, so rotating q and k by
    one R keeps q k^T. Made by ``hadamard_rotation``; ``ptxattn.fp8.quantize`` applies it on
    the GPU.

    Attributes
    ----------
    signs : numpy.ndarray
        float32 (head_dim,), entries +-1.
    head_dim : int
        D, the length of ``signs``.

    Examples
    --------
    >>> import numpy as np
    >>> from ptxattn.fp8 import hadamard_rotation
    >>> rotation = hadamard_rotation(128, seed=0)
    >>> R = rotation.matrix()
    >>> rotation.head_dim, np.allclose(R @ R.T, np.eye(128))
    (128, True)
    """

    signs: np.ndarray  # float32 (head_dim,), entries +-1

    @property
    def head_dim(self) -> int:
        return self.signs.shape[0]

    def matrix(self) -> np.ndarray:
        """The rotation as a float64 (D, D) matrix R, applied as x @ R."""
        return self.signs[:, None].astype(np.float64) * hadamard_matrix(self.head_dim) / math.sqrt(
            self.head_dim)


def hadamard_rotation(head_dim: int, seed: int | None = None) -> HadamardRotation:
    """A random-sign Hadamard rotation of size head_dim, its signs drawn from ``seed``.

    Parameters
    ----------
    head_dim : int
        The size, a power of two.
    seed : int, optional
        Seeds ``numpy.random.default_rng``; None draws fresh entropy.

    Returns
    -------
    HadamardRotation
        The rotation, its signs float32 +-1.

    Raises
    ------
    ValueError
        head_dim not a power of two.

    Examples
    --------
    >>> from ptxattn import fp8
    >>> rotation = fp8.hadamard_rotation(128, seed=0)
    >>> x8, descale = fp8.quantize(x, "block", rotation)   # x8 * descale ~ x @ R
    """
    hadamard_matrix(head_dim)
    signs = np.random.default_rng(seed).choice(np.array([-1.0, 1.0], np.float32), head_dim)
    return HadamardRotation(signs.astype(np.float32))
