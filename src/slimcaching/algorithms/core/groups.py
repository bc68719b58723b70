"""Group forms: one (model, layer) of a cache node's subproblem, as the rows it affects.

A *group* is one (model, layer): all its experts have the same size and the objective is a sum
over groups, so a cache node's subproblem is a knapsack in which group g offers "k of my experts"
with value V_g(k) = the largest latency reduction any k of its experts give (other caches fixed).
Each affected row (a co-activation set of one user class) depends only on which of its <= K
candidate experts are chosen. Three exact forms of the same group: pattern tables over the 2^K
positions (:class:`GroupProblem`), the staircase/prefix form with K terms per row
(:class:`PrefixGroup`), and plain rows for large K (:class:`RowGroup`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def pattern_bits(k: int) -> np.ndarray:
    """[2^k, k] bool: bit j of pattern q."""
    q = np.arange(2**k)
    return ((q[:, None] >> np.arange(k)[None, :]) & 1).astype(bool)


@dataclass
class GroupProblem:
    """Tables of one group: ``keys`` [T, K] candidate index per position (-1: not a candidate),
    ``gains`` [T, 2^K] summed latency reduction for each pattern, ``experts`` the candidate item
    ids (candidate index -> global item)."""

    experts: np.ndarray
    keys: np.ndarray
    gains: np.ndarray

    @property
    def n_candidates(self) -> int:
        return len(self.experts)

    def values(self, masks: np.ndarray) -> np.ndarray:
        """Reduction for each subset in ``masks`` [B, E'] (bool) of candidate experts."""
        b = masks.shape[0]
        ext = np.zeros((b, self.n_candidates + 1), dtype=np.int64)
        ext[:, :-1] = masks
        k = self.keys.shape[1]
        pat = np.zeros((b, len(self.keys)), dtype=np.int64)
        for j in range(k):
            pat |= ext[:, self.keys[:, j]] << j
        return self.gains[np.arange(len(self.keys))[None, :], pat].sum(axis=1)


def build_group(items: np.ndarray, cand: np.ndarray, tables: np.ndarray) -> GroupProblem:
    """``items`` [R, K] global item ids, ``cand`` [R, K] bool candidate positions,
    ``tables`` [R, 2^K] gains per pattern (already weighted)."""
    experts = np.unique(items[cand])
    pos = np.searchsorted(experts, items)
    keys = np.where(cand, pos, -1)
    if len(experts) < 255 and keys.shape[1] <= 8:  # one uint64 per key: a fast 1-d unique
        code = ((keys + 1).astype(np.uint64) << (np.arange(keys.shape[1], dtype=np.uint64) * 8)).sum(
            axis=1, dtype=np.uint64)
        _, first, inv = np.unique(code, return_index=True, return_inverse=True)
        uniq = keys[first]
    else:
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    npat = tables.shape[1]
    flat = (inv.ravel()[:, None] * npat + np.arange(npat)[None, :]).ravel()
    gains = np.bincount(flat, weights=tables.ravel(), minlength=len(uniq) * npat).reshape(len(uniq), npat)
    # the sentinel index -1 must address the always-False column E'
    uniq = np.where(uniq < 0, len(experts), uniq)
    return GroupProblem(experts, uniq, gains)


def prefix_form(pos: np.ndarray, cand: np.ndarray, rc: np.ndarray, v: np.ndarray, local: np.ndarray,
                access: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's value as a sum over the K prefixes of its candidates sorted by remote cost.

    A row's latency is max(local, access + worst) where worst is the largest remote cost of its
    experts not brought to cost ``v`` by the cache. Caching a candidate helps only once every
    costlier candidate is cached too, so the row's reduction depends on a subset P of its
    candidates only through the longest prefix of the cost-sorted candidates P contains: it is a
    staircase g(level(P)), and its Moebius transform is g(l) - g(l-1) on the l-th prefix and zero
    elsewhere. Returns ``masks`` [R, K] (int64 bit mask over candidate indices ``pos`` of the
    l-th prefix) and ``coefs`` [R, K] (the increments, weighted; zero beyond a row's candidates).
    O(R K log K) instead of the O(R 2^K K) of pattern tables.

    ``pos`` [R, K] candidate index per position (any value where ``cand`` is False), ``cand`` [R, K]
    positions the cache can improve (rc > v), ``rc`` [R, K] current remote costs (-inf at absent
    positions), ``v`` [R] cost via this server."""
    r, k = cand.shape
    key = np.where(cand, rc, -np.inf)
    order = np.argsort(-key, axis=1, kind="stable")
    srt = np.take_along_axis(key, order, axis=1)
    rest = np.where(cand, -np.inf, rc).max(axis=1) if k else np.full(r, -np.inf)  # positions the cache cannot improve
    worst = np.empty((r, k + 1))
    worst[:, :k] = srt
    worst[:, k] = -np.inf
    np.maximum(worst, rest[:, None], out=worst)
    np.maximum(worst[:, 1:], v[:, None], out=worst[:, 1:])
    lat = np.maximum(local[:, None], access[:, None] + worst)
    coefs = (lat[:, :-1] - lat[:, 1:]) * w[:, None]
    sorted_cand = np.take_along_axis(cand, order, axis=1)
    bit = np.where(sorted_cand, np.left_shift(1, np.where(sorted_cand, np.take_along_axis(pos, order, axis=1), 0)), 0)
    return np.cumsum(bit.astype(np.int64), axis=1), np.where(sorted_cand, coefs, 0.0)


@dataclass
class PrefixGroup:
    """A group in prefix form (:func:`prefix_form`): ``masks`` [R, K] bit masks over the candidate
    indices and ``coefs`` [R, K] their Moebius coefficients; ``experts`` the candidate item ids.
    For at most :data:`MAX_ZETA_CANDIDATES` candidates (the masks are int64)."""

    experts: np.ndarray
    masks: np.ndarray
    coefs: np.ndarray

    @property
    def n_candidates(self) -> int:
        return len(self.experts)

    def values(self, masks: np.ndarray) -> np.ndarray:
        y = (np.asarray(masks, np.int64) << np.arange(self.n_candidates)).sum(axis=1)
        inside = (self.masks[None, :, :] & ~y[:, None, None]) == 0
        return (inside * self.coefs[None, :, :]).sum(axis=(1, 2))

    def as_patterns(self) -> GroupProblem:
        """The same group as pattern tables (for the approximations that need them)."""
        k = self.masks.shape[1]
        prev = np.concatenate([np.zeros((len(self.masks), 1), np.int64), self.masks[:, :-1]], axis=1)
        newbit = self.masks ^ prev
        cand = newbit != 0
        idx = np.where(cand, np.log2(np.where(cand, newbit, 1)).round().astype(np.int64), 0)
        items = np.where(cand, self.experts[idx] if len(self.experts) else 0, -1)
        # pattern q over the sorted positions: its level is the number of trailing ones
        q = np.arange(2**k)
        level = np.zeros(2**k, np.int64)
        for j in range(k):
            level += np.all(((q[:, None] >> np.arange(j + 1)) & 1) == 1, axis=1)
        cum = np.concatenate([np.zeros((len(self.coefs), 1)), np.cumsum(self.coefs, axis=1)], axis=1)
        tables = cum[:, level]
        # non-candidate positions are never set: their patterns are irrelevant but kept consistent
        return build_group(np.where(cand, items, self.experts.max(initial=0) + 1), cand, tables)


@dataclass
class RowGroup:
    """A group kept as rows (no 2^K pattern tables): for large K. ``pos`` [R, K] candidate index per
    position (E' where not a candidate), ``rc`` current remote costs, ``v`` cost via this server;
    ``staircase``: :meth:`sorted_prefix` when its builder computed it already."""

    experts: np.ndarray
    pos: np.ndarray
    rc: np.ndarray
    v: np.ndarray
    local: np.ndarray
    access: np.ndarray
    w: np.ndarray
    staircase: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def n_candidates(self) -> int:
        return len(self.experts)

    def latency(self, in_y: np.ndarray) -> np.ndarray:
        worst = np.where(in_y, self.v[..., None] if in_y.ndim == 2 else self.v[None, :, None], self.rc).max(axis=-1)
        return np.maximum(self.local, self.access + worst)

    def sorted_prefix(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows in the prefix form of :func:`prefix_form` without bit masks (any E'):
        ``spos`` [R, K] candidate index per position, costliest remote first (E' past a row's
        candidates) and ``coefs`` [R, K] the weighted reduction of completing each prefix."""
        if self.staircase is not None:
            return self.staircase
        e = self.n_candidates
        cand = self.pos < e
        r, k = cand.shape
        key = np.where(cand, self.rc, -np.inf)
        order = np.argsort(-key, axis=1, kind="stable")
        worst = np.empty((r, k + 1))
        worst[:, :k] = np.take_along_axis(key, order, axis=1)
        worst[:, k] = -np.inf
        np.maximum(worst, np.where(cand, -np.inf, self.rc).max(axis=1)[:, None], out=worst)
        np.maximum(worst[:, 1:], self.v[:, None], out=worst[:, 1:])
        lat = np.maximum(self.local[:, None], self.access[:, None] + worst)
        scand = np.take_along_axis(cand, order, axis=1)
        spos = np.where(scand, np.take_along_axis(self.pos, order, axis=1), e)
        # kept: the modular check and the row greedy both ask for it
        self.staircase = (np.ascontiguousarray(spos, np.int64),
                          np.where(scand, (lat[:, :-1] - lat[:, 1:]) * self.w[:, None], 0.0))
        return self.staircase

    def values(self, masks: np.ndarray) -> np.ndarray:
        ext = np.zeros((masks.shape[0], self.n_candidates + 1), bool)
        ext[:, :-1] = masks
        old = self.latency(np.zeros(self.pos.shape, bool))
        return ((old[None, :] - self.latency(ext[:, self.pos])) * self.w[None, :]).sum(axis=1)


def build_row_group(items: np.ndarray, cand: np.ndarray, rc: np.ndarray, v: np.ndarray, local: np.ndarray,
                    access: np.ndarray, w: np.ndarray) -> RowGroup:
    """A :class:`RowGroup` from rows' items, candidate mask, current and via-this-server costs."""
    experts = np.unique(items[cand])
    pos = np.where(cand, np.searchsorted(experts, items), len(experts))
    return RowGroup(experts, pos, rc, v, local, access, w)
