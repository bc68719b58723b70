"""Building blocks shared by the decomposition algorithms and the certificates (bounds).

:mod:`groups` (a (model, layer) group's exact forms), :mod:`values` (its value tables),
:mod:`knapsack` (combining tables under a capacity), :mod:`decomposition` (one cache node's
subproblem given the others), :mod:`kernels` (numba versions of the hot loops).
"""
