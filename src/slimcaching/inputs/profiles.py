"""Activation profiles: per-layer distributions over co-activation sets (docs/model.md §entities).

A :class:`Profile` holds, for each MoE layer, an ``int`` array ``sets`` of shape (n, K) with
sorted distinct expert indices per row and a ``float`` array ``probs`` of shape (n,) summing to 1.
Profiles come from explicit data, JSON/NPZ files, raw routing traces, or the seeded synthetic
router simulator :func:`synthetic_profile`.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slimcaching.errors import ScenarioError, printable
from slimcaching.inputs.fileio import atomic_output, atomic_write, load_npz, npz_headers, parse_json, read_text
from slimcaching.inputs.limits import check, limit

PROB_TOLERANCE = 1e-6
INDEPENDENT = "independent"  # a layer kept as the arguments its sets are drawn from (independent_layer)
_DRAWN_KEYS = ("weights", "always", "top_k", "tokens", "seed")
# at most this many tokens drawn per counts-only layer while profiles are read (None: a file's own)
_DRAW_CAP: contextvars.ContextVar[int | None] = contextvars.ContextVar("slimcaching_draw_cap", default=None)


@contextlib.contextmanager
def draws_at_most(tokens: int | None):
    """Within the block, every counts-only layer read draws at most ``tokens`` tokens: the
    prefix of its own sample (see :func:`gumbel_noise`); None: each file's own number."""
    mark = _DRAW_CAP.set(None if tokens is None else int(tokens))
    try:
        yield
    finally:
        _DRAW_CAP.reset(mark)


@dataclass
class LayerProfile:
    """One layer's co-activation sets (sorted expert ids per row) and their probabilities."""

    sets: np.ndarray  # (n, K) int64, rows sorted ascending, distinct rows
    probs: np.ndarray  # (n,) float64
    # how the sets were drawn, when they were (counts-only imports: independent_layer's arguments);
    # a JSON file keeps these few numbers instead of the sets, which are drawn again on reading
    drawn: dict | None = None
    # the tokens its file draws, when fewer were drawn here (draws_at_most): what identifies the layer
    drawn_from: int | None = None
    # then also each expert's share of the file's own draws: what device caches are chosen by, so
    # that fewer draws change the rows a solver sees and nothing else
    own_marginals: np.ndarray | None = None

    def marginals(self, experts: int) -> np.ndarray:
        """P(expert active) per expert (sums to K): over the file's own draws when fewer were drawn."""
        if self.own_marginals is not None and len(self.own_marginals) == experts:
            return self.own_marginals.copy()
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
            if len(unique_rows(lp.sets)[0]) != len(lp.sets):
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
                {INDEPENDENT: dict(lp.drawn)} if lp.drawn is not None else
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
        noises: dict = {}  # drawn layers of one seed share their noise: made once
        if not isinstance(data["layers"], list):
            raise ScenarioError(f"{where}.layers", "expected a list", data["layers"])
        for li, layer in enumerate(data["layers"]):
            f = f"{where}.layers[{li}]"
            if isinstance(layer, dict) and INDEPENDENT in layer:
                if len(layer) != 1:
                    raise ScenarioError(f, f"'{INDEPENDENT}' stands alone (its sets are drawn from it)",
                                        sorted(layer))
                layers.append(_independent_from_dict(layer[INDEPENDENT], f"{f}.{INDEPENDENT}", noises))
                continue
            if not isinstance(layer, dict) or "sets" not in layer or "probs" not in layer:
                raise ScenarioError(f, f"needs keys 'sets' and 'probs' (or '{INDEPENDENT}')")
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
                sets = sum(len(lp["sets"]) if isinstance(lp.get("sets"), list) else _drawn_tokens(lp)
                           for lp in data["layers"] if isinstance(lp, dict))
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


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of a matrix of ids >= 0 in ``np.unique(axis=0)``'s order, with their
    counts: each row packed into one int64 when it fits in 63 bits (a 1-D sort, ~15x faster).

    >>> unique_rows(np.array([[2, 3], [0, 1], [2, 3]]))
    (array([[0, 1],
           [2, 3]]), array([1, 2]))
    """
    n, k = rows.shape
    bits = max(1, int(rows.max()).bit_length()) if rows.size else 1
    if not rows.size or rows.min() < 0 or k * bits > 63:
        return np.unique(rows, axis=0, return_counts=True)
    shifts = np.arange(k - 1, -1, -1, dtype=np.int64) * bits  # first column most significant: the same order
    keys = (rows.astype(np.int64) << shifts).sum(axis=1)
    uniq, counts = np.unique(keys, return_counts=True)
    return (uniq[:, None] >> shifts) & ((1 << bits) - 1), counts


def group_rows(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Identical rows of a table given column by column (integer ids, or floats compared by
    their bits): the first row of each distinct one and every row's group, distinct rows in the
    columns' lexicographic order (floats by their factorised bits).

    Each column becomes a small integer code (ids as they are, floats factorised) and the codes
    combine into one int64 key per row, re-factorised before it could overflow: a few 1-D sorts
    instead of ``np.unique`` over a void view, whose generic compare is ~5-10x slower.

    >>> idx, inv = group_rows([np.array([1, 0, 1]), np.array([0.5, 2.0, 0.5])])
    >>> idx.tolist(), inv.tolist()
    ([1, 0], [1, 0, 1])
    """
    n = len(columns[0]) if columns else 0
    code, card = np.zeros(n, np.int64), 1
    for col in columns:
        col = np.asarray(col)
        if col.dtype.kind == "f":
            col = col.astype(np.float64).view(np.int64)
        col = col.astype(np.int64, copy=False)
        if n and col.min() >= 0 and int(col.max()) < 1 << 24:
            vals, width = col, int(col.max()) + 1
        else:  # (sorted values, then a binary search: cheaper than unique's inverse when few)
            uniq = np.unique(col)
            vals, width = np.searchsorted(uniq, col), max(1, len(uniq))
        if card * width >= 1 << 62:
            uniq, code = np.unique(code, return_inverse=True)
            card = max(1, len(uniq))
        code = code * width + vals
        card *= width
    _, idx, inv = np.unique(code, return_index=True, return_inverse=True)
    return idx, inv.ravel()


def gumbel_noise(tokens: int, experts: int, seed: int, stream: int = 0) -> np.ndarray:
    """(tokens, experts) standard Gumbel noise from ``seed``, made from PCG64's uniform doubles
    (``Generator.random``, a stream numpy keeps) so that the same seed draws the same sets
    everywhere; a uniform of exactly 0 gives -inf (never drawn). Row t is the same whatever
    ``tokens`` is, so fewer tokens draw a prefix of the same sample. ``stream`` > 0: an
    independent sample of the same seed (the replicates that measure a sample's error)."""
    u = np.random.default_rng([seed, 0x1D] if stream == 0 else [seed, 0x1D, stream]).random((tokens, experts))
    with np.errstate(divide="ignore"):
        return -np.log(-np.log(u))


def draw_rows(noise: np.ndarray, log_weights: np.ndarray, free: int) -> np.ndarray:
    """Each token's ``free`` experts drawn without replacement with chances proportional to the
    weights (Gumbel top-k: the ``free`` largest noise + log-weight): (tokens, free), unsorted."""
    return np.argpartition(-(noise + log_weights), free - 1, axis=1)[:, :free]


def inclusion_counts(noise: np.ndarray, log_weights: np.ndarray, free: int) -> np.ndarray:
    """How many tokens draw each expert: the column counts of :func:`draw_rows`' rows without the
    rows (each token's ``free``-th largest noise + log-weight, then who reaches it), 2.3x faster
    on 20,000 x 128. The same counts wherever no two of a token's values tie exactly (continuous
    noise: never in practice), where :func:`draw_rows` would pick one of the tied."""
    v = noise + log_weights
    cut = v.shape[1] - int(free)
    kth = np.partition(v, cut, axis=1)[:, cut]
    return (v >= kth[:, None]).sum(axis=0)


def log_weights(weights: np.ndarray) -> np.ndarray:
    """log(weights), -inf where a weight is 0 (never drawn)."""
    w = np.asarray(weights, dtype=np.float64)
    return np.where(w > 0, np.log(np.where(w > 0, w, 1.0)), -np.inf)


def independent_layer(weights, always, top_k: int, tokens: int, seed: int,
                      noise: np.ndarray | None = None) -> LayerProfile:
    """A layer's sets under independence: in each of ``tokens`` seeded draws the experts of
    ``always``, and ``top_k - len(always)`` others drawn without replacement with chances
    proportional to ``weights`` (0: never); each distinct set with its share of the draws.

    The same arguments give the same layer: a profile file keeps them (a few numbers per expert)
    instead of the drawn sets. O(tokens * E).
    """
    w = np.asarray(weights, dtype=np.float64)
    forced = np.sort(np.asarray(always, dtype=np.int64))
    free = int(top_k) - len(forced)
    drawn = {"weights": [float(v) for v in w], "always": forced.tolist(), "top_k": int(top_k),
             "tokens": int(tokens), "seed": int(seed)}
    if free == 0:
        return LayerProfile(forced[None, :], np.ones(1), drawn)
    noise = gumbel_noise(tokens, len(w), seed) if noise is None else noise
    rows = np.concatenate([draw_rows(noise, log_weights(w), free), np.broadcast_to(forced, (tokens, len(forced)))],
                          axis=1)
    uniq, n = unique_rows(np.sort(rows, axis=1))
    return LayerProfile(uniq.astype(np.int64), n / n.sum(), drawn)


def drawn_tokens(profile: Profile) -> int:
    """The most tokens any counts-only layer of ``profile`` draws (0: none is drawn)."""
    return max((int(lp.drawn["tokens"]) for lp in profile.layers if lp.drawn is not None), default=0)


def redrawn(profile: Profile, tokens: int, stream: int = 0) -> Profile:
    """``profile`` with each counts-only layer drawn again from its weights on at most ``tokens``
    tokens of noise stream ``stream`` (0: a prefix of the layer's own sample, so ``tokens`` >= its
    own gives the layer unchanged); measured layers are kept as they are. O(tokens * E) a layer."""
    if tokens >= drawn_tokens(profile) and stream == 0:
        return profile
    layers, noises = [], {}
    for lp in profile.layers:
        d = lp.drawn
        if d is None:
            layers.append(lp)
            continue
        key = (min(int(tokens), int(d["tokens"])), len(d["weights"]), int(d["seed"]))
        if key not in noises:
            noises.clear()  # a profile's layers share their noise: one kept
            noises[key] = gumbel_noise(*key, stream=stream)
        layer = independent_layer(np.asarray(d["weights"], np.float64), d["always"], d["top_k"], key[0], key[2],
                                  noises[key])
        own = lp.drawn_from or int(d["tokens"])
        if key[0] < own:
            layer.drawn_from = own
            layer.own_marginals = lp.own_marginals if lp.own_marginals is not None else lp.marginals(key[1])
        layers.append(layer)
    return Profile(profile.model, layers, dict(profile.meta))


def _drawn_tokens(layer: dict) -> int:
    d = layer.get(INDEPENDENT)
    t = d.get("tokens") if isinstance(d, dict) else None
    return t if type(t) is int and t > 0 else 0  # (the file's own, capped or not: its marginals are drawn)


def _independent_from_dict(d, where: str, noises: dict) -> LayerProfile:
    """A layer kept as the arguments of :func:`independent_layer`, checked, then drawn."""
    if not isinstance(d, dict) or sorted(d) != sorted(_DRAWN_KEYS):
        raise ScenarioError(where, f"needs exactly the keys {', '.join(_DRAWN_KEYS)}",
                            sorted(d) if isinstance(d, dict) else type(d).__name__)
    w, always, k, tokens, seed = (d[key] for key in _DRAWN_KEYS)
    if not isinstance(w, list) or not w or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in w):
        raise ScenarioError(f"{where}.weights", "a list of numbers, one per expert")
    check("experts", len(w), f"{where}.weights", "experts")
    try:
        weights = np.asarray(w, dtype=np.float64)
    except OverflowError:  # an integer beyond any float
        weights = np.array([np.inf])
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise ScenarioError(f"{where}.weights", "weights must be finite and >= 0")
    for key, v, lo, hi in (("top_k", k, 1, len(w)), ("tokens", tokens, 1, 2**63 - 1), ("seed", seed, 0, 2**63 - 1)):
        if type(v) is not int or not lo <= v <= hi:
            raise ScenarioError(f"{where}.{key}", f"a whole number from {lo} to {hi}", v)
    cap = _DRAW_CAP.get()
    own, tokens = tokens, tokens if cap is None else min(tokens, cap)
    check("profile_sets", own, f"{where}.tokens", "tokens drawn")  # (the file's own: its marginals are drawn)
    check("drawn_samples", own * len(w), f"{where}.tokens", "tokens x experts drawn")
    if not isinstance(always, list) or any(type(e) is not int or not 0 <= e < len(w) for e in always):
        raise ScenarioError(f"{where}.always", f"expert ids in 0..{len(w) - 1}", always)
    if len(set(always)) != len(always) or len(always) > k:
        raise ScenarioError(f"{where}.always", f"distinct experts, at most top_k={k}", always)
    others = int((np.delete(weights, always) > 0).sum())
    if others < k - len(always):
        raise ScenarioError(f"{where}.weights", f"{others} experts besides 'always' have weight > 0: "
                            f"too few to draw top_k={k}")
    key = (own, len(w), seed)  # the file's own noise: fewer draws take its first rows
    if key not in noises:
        noises.clear()  # one kept: a profile's layers share theirs
        noises[key] = gumbel_noise(*key)
    if tokens == own:
        return independent_layer(weights, always, k, tokens, seed, noises[key])
    # the file's own sample decides the marginals (and so the device caches), exactly as a full
    # read would; only its first rows become the layer's sets
    full = independent_layer(weights, always, k, own, seed, noises[key])
    layer = independent_layer(weights, always, k, tokens, seed, noises[key][:tokens])
    layer.drawn_from, layer.own_marginals = own, full.marginals(len(w))
    return layer


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
            h = self.coupling * (task_mean + rng_tok.standard_normal((tokens, self.rank)))
            eps = rng_tok.standard_normal((tokens, self.experts))
            # h @ emb.T summed rank by rank, not by BLAS: its kernels round differently (with or
            # without fused multiply-add), and the top-K below must not depend on the machine
            factor = h[:, :1] * emb[:, 0]
            for r in range(1, self.rank):
                factor += h[:, r : r + 1] * emb[:, r]
            out[:, layer, :] = bias + factor + self.noise * eps
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


def hub_topic_trace(experts: int, top_k: int, layers: int, tokens: int, seed: int = 0, hubs: int = 4,
                    topics: int = 8, hub_boost: float = 3.0, topic_boost: float = 4.5,
                    zipf: float = 1.75) -> np.ndarray:
    """[tokens, layers, K] routing with the shape trained routers show: a few *hub* experts many
    tokens use, *topics* (clusters of experts a token's subject draws on, one topic per token and
    the same across layers) and a long tail. Per layer the experts are shuffled (seeded), ``hubs``
    of them are hubs and the rest split into ``topics`` clusters; a token of topic j scores every
    expert as ``hub_boost`` [hub] + ``topic_boost`` [in topic j] - ``zipf`` log(rank in its cluster)
    + Gumbel noise and takes the K best, i.e. K draws without replacement with probability
    proportional to exp(score). Topics are drawn Zipf-like (weight 1 / (j + 1)).

    >>> t = hub_topic_trace(64, 8, 2, 500, seed=1)
    >>> t.shape, bool((np.diff(t, axis=2) > 0).all())
    ((500, 2, 8), True)
    """
    if not (0 < top_k <= experts) or hubs < 0 or topics < 1 or hubs + topics > experts:
        raise ScenarioError("hub_topic", f"needs 0 < top_k <= experts and hubs + topics <= experts "
                            f"(got experts={experts}, top_k={top_k}, hubs={hubs}, topics={topics})")
    rng = np.random.default_rng([seed, experts, top_k, layers])
    weights = 1.0 / np.arange(1, topics + 1)
    topic = rng.choice(topics, size=tokens, p=weights / weights.sum())
    out = np.empty((tokens, layers, top_k), dtype=np.int64)
    for layer in range(layers):
        perm = rng.permutation(experts)
        hub, rest = perm[:hubs], perm[hubs:]
        cluster = np.full(experts, -1)
        rank = np.zeros(experts)
        for j, members in enumerate(np.array_split(rest, topics)):
            cluster[members] = j
            rank[members] = np.arange(len(members))
        base = np.where(np.isin(np.arange(experts), hub), hub_boost, 0.0) - zipf * np.log1p(rank)
        score = base[None, :] + topic_boost * (cluster[None, :] == topic[:, None]) + rng.gumbel(size=(tokens, experts))
        top = np.argpartition(-score, top_k - 1, axis=1)[:, :top_k]
        out[:, layer] = np.sort(top, axis=1)
    return out
