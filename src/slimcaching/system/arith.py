"""Sums of products that are the same on every machine.

BLAS's dot and matrix-vector kernels (``a @ b``) add in an order that depends on the kernel OpenBLAS
picks for the CPU (and on its threads), so the last bits of a latency, and any decision between two
near-equal ones, could differ from one machine to the next. These add with numpy's pairwise
summation over a fixed layout instead: plain C, the same order on every CPU.

>>> a = np.array([0.1, 0.2, 0.3]); b = np.array([1.0, 2.0, 3.0])
>>> dot(a, b) == float(np.sum(a * b))
True
"""

from __future__ import annotations

import numpy as np


def dot(a, b) -> float:
    """sum(a * b) of two vectors."""
    return float(np.sum(np.multiply(a, b)))


def vecmat(v, m) -> np.ndarray:
    """``v @ m`` for a vector v and a matrix m: sum over rows of v[i] m[i, :], in row order."""
    return np.sum(np.asarray(v)[:, None] * m, axis=0)


def matvec(m, v) -> np.ndarray:
    """``m @ v`` for a matrix m and a vector v: per row, the pairwise sum of m[i, :] v."""
    return np.sum(m * np.asarray(v)[None, :], axis=1)
