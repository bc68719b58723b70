"""Activation profiles: per-layer distributions over co-activation sets (docs/model.md §entities).

A :class:`Profile` holds, for each MoE layer, an ``int`` array ``sets`` of shape (n, K) with
sorted distinct expert indices per row and a ``float`` array ``probs`` of shape (n,) summing to 1.
Profiles come from explicit data, JSON/NPZ files, raw routing traces, or the seeded synthetic
router simulator :func:`synthetic_profile`.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slimcaching.errors import ScenarioError, printable
from slimcaching.fileio import atomic_output, atomic_write, load_npz, npz_headers, parse_json, read_text
from slimcaching.limits import check, limit

PROB_TOLERANCE = 1e-6


@dataclass
class LayerProfile:
    """One layer's co-activation sets (sorted expert ids per row) and their probabilities."""

    sets: np.ndarray  # (n, K) int64, rows sorted ascending, distinct rows
    probs: np.ndarray  # (n,) float64

    def marginals(self, experts: int) -> np.ndarray:
        out = np.zeros(experts)
        np.add.at(out, self.sets.ravel(), np.repeat(self.probs, self.sets.shape[1]))
        return out


@dataclass
class Profile:
    """An activation profile of one model: a :class:`LayerProfile` per MoE layer."""

    model: str
    layers: list[LayerProfile]
    meta: dict = field(default_factory=dict)

    def validate(self, layers: int, experts: int, top_k: int, where: str = "profile") -> None:
        """Check sizes, ranges, distinctness and normalisation; raise ScenarioError naming the spot."""
        if len(self.layers) != layers:
            raise ScenarioError(
                f"{where}.layers", f"has {len(self.layers)} layers, model {self.model!r} has {layers}"
            )
        for li, lp in enumerate(self.layers):
            f = f"{where}.layers[{li}]"
            if lp.sets.ndim != 2 or lp.sets.shape[1] != top_k:
                raise ScenarioError(f"{f}.sets", f"every set must have top_k={top_k} experts",
                                    lp.sets.tolist()[:3])
            if lp.sets.shape[0] != lp.probs.shape[0] or lp.sets.shape[0] == 0:
                raise ScenarioError(f"{f}.probs",
                                    f"need one probability per set ({lp.sets.shape[0]} sets)",
                                    lp.probs.tolist()[:5])
            if lp.sets.size and (lp.sets.min() < 0 or lp.sets.max() >= experts):
                bad = lp.sets[(lp.sets < 0) | (lp.sets >= experts)][0]
                raise ScenarioError(f"{f}.sets", f"expert index out of range 0..{experts - 1}",
                                    int(bad))
            if top_k > 1 and np.any(np.diff(lp.sets, axis=1) <= 0):
                row = lp.sets[np.any(np.diff(lp.sets, axis=1) <= 0, axis=1)][0]
                raise ScenarioError(f"{f}.sets", "a set must hold distinct experts sorted ascending",
                                    row.tolist())
            if len(np.unique(lp.sets, axis=0)) != len(lp.sets):
                raise ScenarioError(f"{f}.sets", "a set is listed twice")
            if np.any(~np.isfinite(lp.probs)) or np.any(lp.probs < 0):
                raise ScenarioError(f"{f}.probs", "probabilities must be finite and >= 0",
                                    lp.probs.tolist()[:5])
            total = float(lp.probs.sum())
            if abs(total - 1.0) > PROB_TOLERANCE:
                raise ScenarioError(f"{f}.probs", f"probabilities sum to {total!r}, not 1")

    # ---- (de)serialisation -------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "layers": [
                {"sets": lp.sets.tolist(), "probs": [float(p) for p in lp.probs]} for lp in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> Profile:
        if not isinstance(data, dict):
            raise ScenarioError(where, "expected a mapping with 'model' and 'layers'", data)
        if "model" not in data or "layers" not in data:
            raise ScenarioError(where, "needs keys 'model' and 'layers'", sorted(data))
        layers = []
        if not isinstance(data["layers"], list):
            raise ScenarioError(f"{where}.layers", "expected a list", data["layers"])
        for li, layer in enumerate(data["layers"]):
            f = f"{where}.layers[{li}]"
            if not isinstance(layer, dict) or "sets" not in layer or "probs" not in layer:
                raise ScenarioError(f, "needs keys 'sets' and 'probs'")
            raw_sets, raw_probs = layer["sets"], layer["probs"]
            if not isinstance(raw_sets, list) or not isinstance(raw_probs, list):
                raise ScenarioError(f, "sets and probs must be lists")
            for si, row in enumerate(raw_sets):
                items = row if isinstance(row, list) else [row]
                if not items or any(type(v) is not int for v in items):  # no bools, no 0.7 read as 0
                    raise ScenarioError(f"{f}.sets[{si}]", "a set must be a list of integer expert indices", row)
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in raw_probs):
                bad = next(v for v in raw_probs if isinstance(v, bool) or not isinstance(v, (int, float)))
                raise ScenarioError(f"{f}.probs", "probabilities must be numbers", bad)
            lens = {len(row) if isinstance(row, list) else 1 for row in raw_sets}
            if len(lens) > 1:
                raise ScenarioError(f"{f}.sets", f"sets of different sizes {sorted(lens)}: each needs top_k experts")
            try:
                sets = np.asarray(raw_sets, dtype=np.int64)
                probs = np.asarray(raw_probs, dtype=np.float64)
            except (ValueError, TypeError, OverflowError) as exc:
                raise ScenarioError(f, f"sets must be lists of integers, probs numbers ({exc})") from None
            if sets.ndim == 1 and sets.size and probs.size == sets.size:
                sets = sets[:, None]
            if sets.size == 0:
                sets = sets.reshape(0, 1)
            layers.append(LayerProfile(sets, probs))
        meta = {k: v for k, v in data.items() if k not in ("model", "layers")}
        return cls(str(data["model"]), layers, meta)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.suffix == ".json":
            out = self.to_dict()
            out.update({k: v for k, v in self.meta.items() if k not in out})

            atomic_write(path, json.dumps(out, indent=1, allow_nan=False) + "\n")
        elif path.suffix == ".npz":
            counts = np.array([len(lp.probs) for lp in self.layers], dtype=np.int64)
            k = self.layers[0].sets.shape[1] if self.layers else 1

            with atomic_output(path, suffix=".npz") as tmp, open(tmp, "wb") as fh:
                np.savez_compressed(
                    fh,
                    model=np.array(self.model),
                    counts=counts,
                    sets=np.concatenate([lp.sets for lp in self.layers]).reshape(-1, k).astype(np.int32),
                    probs=np.concatenate([lp.probs for lp in self.layers]),
                    meta=np.array(json.dumps(self.meta)),
                )
        else:
            raise ScenarioError("output", "profile files end in .json or .npz", str(path))

    @classmethod
    def load(cls, path: str | Path, where: str = "profile") -> Profile:
        """A profile file (``.json`` or ``.npz``), checked on its own (:meth:`check`); sizes are
        checked against the ``profile_sets`` limit before anything large is built."""
        path = Path(path)
        if path.suffix == ".json":
            data = parse_json(read_text(path, where), path, where)
            if isinstance(data, dict) and isinstance(data.get("layers"), list):
                sets = sum(len(lp["sets"]) for lp in data["layers"] if isinstance(lp, dict)
                           and isinstance(lp.get("sets"), list))
                check("profile_sets", sets, f"{where}.layers", "co-activation sets")
            prof = cls.from_dict(data, where)
        elif path.suffix == ".npz":
            headers = npz_headers(path, where)
            missing = [k for k in ("counts", "sets", "probs", "model") if k not in headers]
            if missing:
                raise ScenarioError(where, f"{path} is not a slimcaching profile npz (no {missing[0]!r})")
            check("profile_sets", headers["sets"][0][0] if headers["sets"][0] else 0, f"{where}.sets",
                  "co-activation sets")
            check("layers", math.prod(headers["counts"][0]), f"{where}.counts", "layers")
            z = load_npz(path, where, max_entries=(limit("profile_sets") + 1) * 66 + limit("layers"))
            try:
                counts = z["counts"].astype(np.int64).reshape(-1)
                sets = z["sets"].astype(np.int64)
                probs = z["probs"].astype(np.float64).reshape(-1)
                model = str(z["model"])
                meta = json.loads(str(z["meta"])) if "meta" in z else {}
            except (ValueError, TypeError, json.JSONDecodeError) as exc:
                raise ScenarioError(where, f"{path} is not a slimcaching profile npz ({str(exc)[:80]})") from None
            if sets.ndim != 2 or (counts < 0).any() or int(counts.sum()) != len(sets) or len(probs) != len(sets):
                raise ScenarioError(where, f"{path}: counts, sets and probs do not fit together")
            bounds = np.concatenate([[0], np.cumsum(counts)])
            layers = [LayerProfile(sets[a:b], probs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
            prof = cls(model, layers, meta if isinstance(meta, dict) else {})
        else:
            raise ScenarioError(where, "profile files end in .json or .npz", str(path))
        prof.check(where)
        return prof

    def check(self, where: str = "profile") -> None:
        """The checks of :meth:`validate` that need no model: every layer's sets of one size K
        (the same in every layer), expert ids >= 0, distinct and sorted, probabilities finite,
        non-negative, summing to 1."""
        printable(self.model, f"{where}.model")
        if not self.layers:
            raise ScenarioError(f"{where}.layers", "a profile needs at least one layer")
        k = self.layers[0].sets.shape[1] if self.layers[0].sets.ndim == 2 else 0
        top = max((int(lp.sets.max()) for lp in self.layers if lp.sets.size), default=0)
        self.validate(len(self.layers), max(top + 1, 1), max(k, 1), where)


def profile_from_trace(trace: np.ndarray, model: str, meta: dict | None = None) -> Profile:
    """Count a routing trace of shape (tokens, layers, K) into a profile.

    Each row's expert ids are sorted; a row of K distinct experts is one co-activation set.
    """
    trace = np.asarray(trace)
    if trace.ndim != 3 or trace.shape[0] == 0:
        raise ScenarioError("trace", "expected a (tokens, layers, K) array with at least one token",
                            getattr(trace, "shape", None))
    tokens = trace.shape[0]
    layers = []
    for li in range(trace.shape[1]):
        rows = np.sort(trace[:, li, :], axis=1)
        uniq, counts = np.unique(rows, axis=0, return_counts=True)
        layers.append(LayerProfile(uniq.astype(np.int64), counts / tokens))
    m = {"tokens": int(tokens)}
    m.update(meta or {})
    return Profile(model, layers, m)


def stable_hash(text: str) -> int:
    """A hash of a string that is the same in every process (for seeds)."""
    return zlib.crc32(text.encode())


@dataclass(frozen=True)
class RouterSimulator:
    """Seeded simulated router: logits = task bias + low-rank token factor + noise; take top-K.

    ``skew`` scales the per-layer bias (larger: more concentrated experts), ``shared`` is the
    share of bias variance common to all tasks (0: tasks unrelated, 1: identical), ``coupling``
    scales a rank-``rank`` token factor that makes some experts fire together (co-activation),
    ``noise`` the per-token independent noise.
    """

    experts: int
    top_k: int
    layers: int
    skew: float = 1.5
    shared: float = 0.3
    coupling: float = 1.0
    rank: int = 2
    noise: float = 0.7
    seed: int = 0
    model_key: str = "model"

    def logits(self, task: str, tokens: int, token_seed: int | None = None) -> np.ndarray:
        """Return router logits of shape (tokens, layers, experts)."""
        mk, tk = stable_hash(self.model_key), stable_hash(task)
        rng_tok = np.random.default_rng([self.seed, mk, tk, 7 if token_seed is None else token_seed + 11])
        out = np.empty((tokens, self.layers, self.experts))
        for layer in range(self.layers):
            rng_m = np.random.default_rng([self.seed, mk, layer])
            base = rng_m.standard_normal(self.experts)
            emb = rng_m.standard_normal((self.experts, self.rank)) / np.sqrt(self.rank)
            rng_t = np.random.default_rng([self.seed, mk, tk, layer])
            task_bias = rng_t.standard_normal(self.experts)
            task_mean = rng_t.standard_normal(self.rank)
            bias = self.skew * (np.sqrt(self.shared) * base + np.sqrt(1 - self.shared) * task_bias)
            h = task_mean + rng_tok.standard_normal((tokens, self.rank))
            eps = rng_tok.standard_normal((tokens, self.experts))
            out[:, layer, :] = bias + self.coupling * h @ emb.T + self.noise * eps
        return out

    def trace(self, task: str, tokens: int, token_seed: int | None = None) -> np.ndarray:
        logits = self.logits(task, tokens, token_seed)
        top = np.argpartition(-logits, self.top_k - 1, axis=2)[:, :, : self.top_k]
        return np.sort(top, axis=2)


def synthetic_profile(model: str, experts: int, top_k: int, layers: int, task: str,
                      tokens: int = 2000, seed: int = 0, **params) -> Profile:
    """Profile measured on ``tokens`` simulated tokens of ``task`` (see :class:`RouterSimulator`)."""
    if tokens < 1:
        raise ScenarioError("synthetic.tokens", "must be >= 1", tokens)
    if top_k > experts:
        raise ScenarioError("synthetic", f"top_k={top_k} exceeds experts={experts}")
    sim = RouterSimulator(experts, top_k, layers, seed=seed, model_key=model, **params)
    meta = {"synthetic": {"task": task, "seed": seed, **params}}
    return profile_from_trace(sim.trace(task, tokens), model, meta)
