"""Classical ML kernels (ai.onnx.ml)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._registry import KernelContext, kernel, kernel_builder

_ML = "ai.onnx.ml"


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _texts(values) -> list[str]:
    return [_text(v) for v in values]


def _as_rows(x: np.ndarray) -> np.ndarray:
    """Most ai.onnx.ml ops treat a 1-D input as a single row."""
    return x.reshape(1, -1) if x.ndim == 1 else x


# ----------------------------------------------------------------------------- post transforms


def _logistic(scores: np.ndarray) -> np.ndarray:
    # 1 / (1 + exp(-|v|)), mirrored for negative values: no overflow for large |v|
    positive = 1.0 / (1.0 + np.exp(-np.abs(scores)))
    return np.where(scores < 0, 1.0 - positive, positive).astype(scores.dtype, copy=False)


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def _softmax_zero(scores: np.ndarray) -> np.ndarray:
    """Softmax in which (near-)zero scores keep a zero-like weight, as onnxruntime computes it."""
    high = scores.max(axis=1, keepdims=True)
    nonzero = np.abs(scores) > 1e-7
    values = np.where(nonzero, np.exp(scores - high), scores * np.exp(-high))
    total = values.sum(axis=1, keepdims=True)
    safe_total = np.where(total == 0, 1, total)
    return np.where(total == 0, scores.dtype.type(0.5), values / safe_total).astype(scores.dtype, copy=False)


def _erf_inv(x: np.ndarray) -> np.ndarray:
    """Winitzki's approximation of erfinv (what onnxruntime and onnx.reference use for PROBIT)."""
    sign = np.where(x < 0, -1.0, 1.0)
    t = (1.0 - x) * (1.0 + x)
    with np.errstate(divide="ignore", invalid="ignore"):
        log = np.log(t)
        v = 2.0 / (np.pi * 0.147) + 0.5 * log
        v2 = 1.0 / 0.147 * log
        out = sign * np.sqrt(-v + np.sqrt(v * v - v2))
    return np.where(t == 0, 0.0, out)


def _probit(scores: np.ndarray) -> np.ndarray:
    return (1.41421356 * _erf_inv(scores.astype(np.float64) * 2 - 1)).astype(scores.dtype)


_POST_TRANSFORMS = {
    "NONE": lambda s: s,
    "LOGISTIC": _logistic,
    "SOFTMAX": _softmax,
    "SOFTMAX_ZERO": _softmax_zero,
    "PROBIT": _probit,
}
# TreeEnsemble (opset 5) numbers its post transforms
_POST_TRANSFORM_NAMES = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")


def _post_transform(name: str):
    try:
        return _POST_TRANSFORMS[name]
    except KeyError:
        raise NotImplementedError(f"post_transform {name!r} is not supported") from None


# ----------------------------------------------------------------------------- simple ops


@kernel("ArrayFeatureExtractor", 1, domain=_ML)
def array_feature_extractor(x, indices):
    index = indices.reshape(-1)
    if index.size and (index.min() < -x.shape[-1] or index.max() >= x.shape[-1]):
        raise IndexError(f"ArrayFeatureExtractor: an index in {indices.tolist()} is out of range for {x.shape[-1]} features")
    out = np.take(x, index, axis=-1)
    if x.ndim == 1:
        return out.reshape(1, -1)
    return out


@kernel("Binarizer", 1, domain=_ML)
def binarizer(x, *, threshold=0.0):
    return (x > threshold).astype(x.dtype)


@kernel("Normalizer", 1, domain=_ML)
def normalizer(x, *, norm="MAX"):
    norm = _text(norm)
    x = _as_rows(x)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float32)
    if norm == "MAX":
        div = np.abs(x).max(axis=1, keepdims=True)
    elif norm == "L1":
        div = np.abs(x).sum(axis=1, keepdims=True)
    elif norm == "L2":
        div = np.sqrt(np.square(x).sum(axis=1, keepdims=True))
    else:
        raise ValueError(f"Normalizer: norm must be 'MAX', 'L1' or 'L2', got {norm!r}")
    return (x / np.maximum(div, 1e-30)).astype(np.float32, copy=False)


@kernel("Scaler", 1, domain=_ML)
def scaler(x, *, offset=None, scale=None):
    offset = np.asarray(offset if offset is not None else [0.0], dtype=np.float32)
    scale = np.asarray(scale if scale is not None else [1.0], dtype=np.float32)
    return ((x.astype(np.float32, copy=False) - offset) * scale).astype(np.float32, copy=False)


class _Lookup:
    """A vectorised dictionary: sorted keys + searchsorted, the last duplicate key winning."""

    def __init__(self, keys: np.ndarray, values: np.ndarray, default: Any, out_dtype: np.dtype):
        self.is_text = keys.dtype == object or keys.dtype.kind in "US"
        keys = np.asarray(_texts(keys), dtype=np.str_) if self.is_text else keys
        order = np.argsort(keys, kind="stable")
        self.keys = keys[order]
        self.values = np.asarray(values, dtype=out_dtype)[order] if len(values) else np.asarray(values, dtype=out_dtype)
        self.default = default
        self.out_dtype = out_dtype

    def __call__(self, x: np.ndarray) -> np.ndarray:
        probe = x.astype(np.str_) if self.is_text else x
        out = np.full(x.shape, self.default, dtype=self.out_dtype)
        if not self.keys.size:
            return out
        keys = self.keys if self.is_text else self.keys.astype(np.result_type(self.keys, probe), copy=False)
        position = np.searchsorted(keys, probe, side="right") - 1
        clipped = np.maximum(position, 0)
        # NaN never equals a key, so NaN inputs take the default (as onnxruntime and onnx.reference do)
        found = (position >= 0) & (keys[clipped] == probe)
        out[found] = self.values[clipped[found]]
        return out


_FLOAT_DEFAULT = -0.0


def _label_encoder_v2(attributes: dict[str, Any]) -> _Lookup:
    keys_tensor = attributes.get("keys_tensor")
    values_tensor = attributes.get("values_tensor")
    if keys_tensor is not None:
        keys = keys_tensor.ravel()
    elif attributes.get("keys_strings") is not None:
        keys = np.asarray(_texts(attributes["keys_strings"]), dtype=object)
    elif attributes.get("keys_int64s") is not None:
        keys = np.asarray(attributes["keys_int64s"], dtype=np.int64)
    elif attributes.get("keys_floats") is not None:
        keys = np.asarray(attributes["keys_floats"], dtype=np.float32)
    else:
        raise ValueError("LabelEncoder: one of keys_strings, keys_int64s, keys_floats, keys_tensor is required")

    if values_tensor is not None:
        values = values_tensor.ravel()
        dtype = values.dtype
        if dtype.kind == "O":
            values = np.asarray(_texts(values), dtype=object)
    elif attributes.get("values_strings") is not None:
        values, dtype = np.asarray(_texts(attributes["values_strings"]), dtype=object), np.dtype(object)
    elif attributes.get("values_int64s") is not None:
        values, dtype = np.asarray(attributes["values_int64s"], dtype=np.int64), np.dtype(np.int64)
    elif attributes.get("values_floats") is not None:
        values, dtype = np.asarray(attributes["values_floats"], dtype=np.float32), np.dtype(np.float32)
    else:
        raise ValueError("LabelEncoder: one of values_strings, values_int64s, values_floats, values_tensor is required")
    if len(keys) != len(values):
        raise ValueError(f"LabelEncoder: {len(keys)} keys but {len(values)} values")

    default_tensor = attributes.get("default_tensor")
    if values_tensor is not None and default_tensor is not None:
        default = _text(default_tensor.ravel()[0])
    elif dtype.kind == "O":
        default = _text(attributes.get("default_string", "_Unused"))
    elif dtype.kind in "iu":
        default = attributes.get("default_int64", -1)
    else:
        default = attributes.get("default_float", _FLOAT_DEFAULT)
    return _Lookup(keys, values, default, dtype)


@kernel_builder("LabelEncoder", 1, 2, 4, domain=_ML)
def label_encoder(ctx: KernelContext):
    attributes = ctx.attributes
    if ctx.opset >= 2:
        return _label_encoder_v2(attributes)
    classes = _texts(attributes.get("classes_strings") or [])
    default_int64 = attributes.get("default_int64", -1)
    default_string = _text(attributes.get("default_string", "_Unused"))
    to_index = _Lookup(np.asarray(classes, dtype=object), np.arange(len(classes), dtype=np.int64), default_int64, np.dtype(np.int64))
    to_string = _Lookup(np.arange(len(classes), dtype=np.int64), np.asarray(classes, dtype=object), default_string, np.dtype(object))

    def run(x):
        return to_index(x) if x.dtype == object or x.dtype.kind in "US" else to_string(x.astype(np.int64))

    return run


@kernel_builder("CategoryMapper", 1, domain=_ML)
def category_mapper(ctx: KernelContext):
    attributes = ctx.attributes
    strings = np.asarray(_texts(attributes.get("cats_strings") or []), dtype=object)
    ints = np.asarray(attributes.get("cats_int64s") or [], dtype=np.int64)
    if len(strings) != len(ints):
        raise ValueError("CategoryMapper: cats_strings and cats_int64s must have the same length")
    to_int = _Lookup(strings, ints, attributes.get("default_int64", -1), np.dtype(np.int64))
    to_string = _Lookup(ints, strings, _text(attributes.get("default_string", "_Unused")), np.dtype(object))

    def run(x):
        return to_int(x) if x.dtype == object or x.dtype.kind in "US" else to_string(x)

    return run


@kernel_builder("OneHotEncoder", 1, domain=_ML)
def one_hot_encoder(ctx: KernelContext):
    attributes = ctx.attributes
    if attributes.get("cats_int64s"):
        categories = np.asarray(attributes["cats_int64s"], dtype=np.int64)
    elif attributes.get("cats_strings"):
        categories = np.asarray(_texts(attributes["cats_strings"]), dtype=object)
    else:
        raise ValueError("OneHotEncoder: cats_int64s or cats_strings is required")
    zeros = attributes.get("zeros", 1)
    position = _Lookup(categories, np.arange(len(categories), dtype=np.int64), -1, np.dtype(np.int64))

    def run(x):
        if categories.dtype != object and x.dtype.kind == "f":
            # float inputs are matched after truncation to int64, as onnxruntime does
            x = x.astype(np.int64)
        index = position(x)
        out = (index[..., None] == np.arange(len(categories))).astype(np.float32)
        if not zeros and np.any(index < 0):
            raise ValueError("OneHotEncoder: an input value is not among the categories and zeros=0")
        return out

    return run


@kernel("Imputer", 1, domain=_ML)
def imputer(x, *, imputed_value_floats=None, imputed_value_int64s=None, replaced_value_float=0.0, replaced_value_int64=0):
    if imputed_value_floats:
        values, replaced = np.asarray(imputed_value_floats, dtype=x.dtype), replaced_value_float
    elif imputed_value_int64s:
        values, replaced = np.asarray(imputed_value_int64s, dtype=x.dtype), replaced_value_int64
    else:
        raise ValueError("Imputer: imputed_value_floats or imputed_value_int64s is required")
    rows = _as_rows(x)
    if values.size not in (1, rows.shape[-1]):
        raise ValueError(f"Imputer: {values.size} imputed values for {rows.shape[-1]} features")
    missing = np.isnan(rows) if (x.dtype.kind == "f" and np.isnan(replaced)) else rows == replaced
    return np.where(missing, values, rows).astype(x.dtype, copy=False).reshape(x.shape)


@kernel("FeatureVectorizer", 1, domain=_ML)
def feature_vectorizer(*inputs, inputdimensions=None):
    dims = list(inputdimensions or [])
    if len(dims) != len(inputs):
        raise ValueError(f"FeatureVectorizer: {len(inputs)} inputs but {len(dims)} inputdimensions")
    columns = []
    for x, width in zip(inputs, dims):
        x = x.reshape(-1, 1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
        x = x.astype(np.float32, copy=False)
        if x.shape[1] > width:
            x = x[:, :width]
        elif x.shape[1] < width:
            x = np.pad(x, [(0, 0), (0, width - x.shape[1])])
        columns.append(x)
    return np.concatenate(columns, axis=1)


def _linear_scores(x, coefficients, intercepts, n_outputs):
    dtype = np.float64 if x.dtype == np.float64 else np.float32
    x = _as_rows(x).astype(dtype, copy=False)
    weights = np.asarray(coefficients, dtype=dtype).reshape(n_outputs, -1).T
    scores = x @ weights
    if intercepts:
        scores += np.asarray(intercepts, dtype=dtype)
    return scores


@kernel("LinearRegressor", 1, domain=_ML)
def linear_regressor(x, *, coefficients=None, intercepts=None, targets=1, post_transform="NONE"):
    scores = _linear_scores(x, coefficients or [], intercepts, targets)
    return _post_transform(_text(post_transform))(scores).astype(np.float32, copy=False)


@kernel("LinearClassifier", 1, domain=_ML, multi_output=True)
def linear_classifier(
    x, *, coefficients, intercepts=None, classlabels_ints=None, classlabels_strings=None, multi_class=0,
    post_transform="NONE",
):
    post_transform = _text(post_transform)
    n_features = _as_rows(x).shape[1]
    scores = _linear_scores(x, coefficients, intercepts, len(coefficients) // n_features)
    labels_list = classlabels_ints if classlabels_ints else (_texts(classlabels_strings) if classlabels_strings else None)
    n_classes = len(labels_list or [])
    if scores.shape[1] == 1 and n_classes == 2:
        scores = np.concatenate([-scores, scores], axis=1)
    scores = _post_transform(post_transform)(scores)
    if scores.shape[1] > 1:
        index = np.argmax(scores, axis=1)
        labels = np.asarray(labels_list, dtype=object if classlabels_strings else np.int64)[index] if labels_list else index
    else:
        threshold = 0 if post_transform == "NONE" else 0.5
        hit = scores[:, 0] >= threshold
        if classlabels_strings:
            labels = np.where(hit, labels_list[0], "").astype(object)
        elif classlabels_ints:
            labels = np.where(hit, labels_list[0], 0).astype(np.int64)
        else:
            labels = hit.astype(np.int64)
    return labels.astype(object if classlabels_strings else np.int64), scores.astype(np.float32, copy=False)


# ----------------------------------------------------------------------------- tree ensembles

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_MODE_CODES = {
    "BRANCH_LEQ": _LEQ, "BRANCH_LT": _LT, "BRANCH_GTE": _GTE, "BRANCH_GT": _GT,
    "BRANCH_EQ": _EQ, "BRANCH_NEQ": _NEQ, "BRANCH_MEMBER": _MEMBER,
}
_COMPARE = {
    _LEQ: np.less_equal, _LT: np.less, _GTE: np.greater_equal, _GT: np.greater, _EQ: np.equal, _NEQ: np.not_equal,
}


class _Forest:
    """Trees in flat arrays, walked level by level for all samples and trees at once.

    Nodes and leaves share one index space; each leaf owns a run of (target, weight)
    entries in `entry_target` / `entry_weight` starting at `entry_start`."""

    def __init__(
        self, *, feature, split, mode, true_next, false_next, is_leaf, missing_true, roots, members,
        entry_start, entry_count, entry_target, entry_weight, nan_follows_missing_only,
    ):
        self.feature = np.asarray(feature, dtype=np.int64)
        self.split = np.asarray(split)
        self.mode = np.asarray(mode, dtype=np.int64)
        self.true_next = np.asarray(true_next, dtype=np.int64)
        self.false_next = np.asarray(false_next, dtype=np.int64)
        self.is_leaf = np.asarray(is_leaf, dtype=bool)
        self.missing_true = np.asarray(missing_true, dtype=bool)
        self.roots = np.asarray(roots, dtype=np.int64)
        self.entry_start = np.asarray(entry_start, dtype=np.int64)
        self.entry_count = np.asarray(entry_count, dtype=np.int64)
        self.entry_target = np.asarray(entry_target, dtype=np.int64)
        self.entry_weight = np.asarray(entry_weight)
        self.nan_follows_missing_only = nan_follows_missing_only
        branch_modes = self.mode[~self.is_leaf]
        self.modes_present = sorted(set(branch_modes.tolist()))
        self.track_missing = bool(self.missing_true[~self.is_leaf].any())
        # set-membership nodes: one padded row of members per node (NaN never matches)
        self.member_row = np.zeros(len(self.mode), dtype=np.int64)
        if members:
            width = max(len(m) for m in members.values()) or 1
            table = np.full((len(members), width), np.nan)
            for row, (node, values) in enumerate(members.items()):
                table[row, : len(values)] = values
                self.member_row[node] = row
            self.members = table
        else:
            self.members = np.full((0, 1), np.nan)
        for ids in (self.true_next, self.false_next):
            if ids[~self.is_leaf].size and (ids[~self.is_leaf].min() < 0 or ids[~self.is_leaf].max() >= len(self.mode)):
                raise ValueError("tree ensemble: a node points outside the ensemble")

    def _branch(self, value: np.ndarray, node: np.ndarray) -> np.ndarray:
        mode = self.mode[node]
        if len(self.modes_present) == 1 and self.modes_present[0] != _MEMBER:
            taken = _COMPARE[self.modes_present[0]](value, self.split[node])
        else:
            taken = np.zeros(value.shape, dtype=bool)
            for code in self.modes_present:
                selected = np.flatnonzero(mode == code)
                if not selected.size:
                    continue
                v = value[selected]
                if code == _MEMBER:
                    rows = self.members[self.member_row[node[selected]]]
                    taken[selected] = (v[:, None] == rows).any(axis=1)
                else:
                    taken[selected] = _COMPARE[code](v, self.split[node[selected]])
        if self.nan_follows_missing_only:
            missing = np.isnan(value)
            taken = np.where(missing, self.missing_true[node], taken)
        elif self.track_missing:
            taken |= np.isnan(value) & self.missing_true[node]
        return taken

    def leaves(self, x: np.ndarray) -> np.ndarray:
        """The leaf each (sample, tree) reaches, shape (N, trees)."""
        n, trees = x.shape[0], len(self.roots)
        index = np.tile(self.roots, n)
        sample = np.repeat(np.arange(n), trees)
        active = np.flatnonzero(~self.is_leaf[index])
        with np.errstate(invalid="ignore"):
            for _ in range(len(self.mode) + 1):
                if not active.size:
                    break
                node = index[active]
                value = x[sample[active], self.feature[node]]
                nxt = np.where(self._branch(value, node), self.true_next[node], self.false_next[node])
                index[active] = nxt
                active = active[~self.is_leaf[nxt]]
            else:
                raise ValueError("tree ensemble: the trees contain a cycle")
        return index.reshape(n, trees)

    def scores(self, x: np.ndarray, n_targets: int, aggregate: str, dtype: np.dtype) -> np.ndarray:
        """Aggregated leaf weights per sample and target, shape (N, n_targets)."""
        x = _as_rows(x)
        n = x.shape[0]
        if self.feature[~self.is_leaf].size and self.feature[~self.is_leaf].max() >= x.shape[1]:
            raise ValueError(f"tree ensemble: a node reads feature {self.feature.max()} but X has {x.shape[1]} features")
        leaves = self.leaves(x).ravel()
        counts = self.entry_count[leaves]
        sample = np.repeat(np.repeat(np.arange(n), len(self.roots)), counts)
        first = np.repeat(self.entry_start[leaves], counts)
        offset = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        entry = first + offset
        flat = sample * n_targets + self.entry_target[entry]
        weight = self.entry_weight[entry]
        if aggregate in ("SUM", "AVERAGE"):
            out: np.ndarray = np.bincount(flat, weights=weight, minlength=n * n_targets).reshape(n, n_targets)
            if aggregate == "AVERAGE":
                out /= len(self.roots)
            return out.astype(dtype, copy=False)
        if aggregate == "MIN":
            out = np.full(n * n_targets, np.finfo(dtype).max, dtype=dtype)
            np.minimum.at(out, flat, weight.astype(dtype))
        elif aggregate == "MAX":
            out = np.full(n * n_targets, np.finfo(dtype).min, dtype=dtype)
            np.maximum.at(out, flat, weight.astype(dtype))
        else:
            raise NotImplementedError(f"tree ensemble: aggregate_function {aggregate!r} is not supported")
        return out.reshape(n, n_targets)


_AGGREGATES_V5 = ("AVERAGE", "SUM", "MIN", "MAX")


@kernel_builder("TreeEnsemble", 5, domain=_ML)
def tree_ensemble(ctx: KernelContext):
    a = ctx.attributes
    splits = np.asarray(a["nodes_splits"]).ravel()
    modes = np.asarray(a["nodes_modes"]).ravel().astype(np.int64)
    n_nodes = len(modes)
    true_ids = np.asarray(a["nodes_truenodeids"], dtype=np.int64)
    false_ids = np.asarray(a["nodes_falsenodeids"], dtype=np.int64)
    true_leaf = np.asarray(a["nodes_trueleafs"], dtype=bool)
    false_leaf = np.asarray(a["nodes_falseleafs"], dtype=bool)
    leaf_targets = np.asarray(a["leaf_targetids"], dtype=np.int64)
    leaf_weights = np.asarray(a["leaf_weights"]).ravel()
    n_leaves = len(leaf_targets)
    missing = a.get("nodes_missing_value_tracks_true")
    missing = np.asarray(missing, dtype=bool) if missing else np.zeros(n_nodes, dtype=bool)
    n_targets = a.get("n_targets")
    if n_targets is None:
        raise ValueError("TreeEnsemble: n_targets is required")
    aggregate = _AGGREGATES_V5[a.get("aggregate_function", 1)]
    post = _post_transform(_POST_TRANSFORM_NAMES[a.get("post_transform", 0)])

    members: dict[int, list[float]] = {}
    member_nodes = np.flatnonzero(modes == _MEMBER)
    if member_nodes.size:
        values = a.get("membership_values")
        if values is None:
            raise ValueError("TreeEnsemble: BRANCH_MEMBER nodes need membership_values")
        values = np.asarray(values, dtype=np.float64).ravel()
        breaks = np.flatnonzero(np.isnan(values))
        if len(breaks) != member_nodes.size:
            raise ValueError("TreeEnsemble: membership_values must hold one NaN-terminated set per BRANCH_MEMBER node")
        starts = np.concatenate([[0], breaks[:-1] + 1])
        members = {int(node): values[s:e].tolist() for node, s, e in zip(member_nodes, starts, breaks)}

    # leaves live after the nodes in one index space
    roots = np.asarray(a["tree_roots"], dtype=np.int64)
    degenerate = true_leaf[roots] & false_leaf[roots] & (true_ids[roots] == false_ids[roots])
    forest = _Forest(
        feature=np.concatenate([np.asarray(a["nodes_featureids"], dtype=np.int64), np.zeros(n_leaves, np.int64)]),
        split=np.concatenate([splits, np.zeros(n_leaves, splits.dtype)]),
        mode=np.concatenate([modes, np.zeros(n_leaves, np.int64)]),
        true_next=np.concatenate([np.where(true_leaf, true_ids + n_nodes, true_ids), np.zeros(n_leaves, np.int64)]),
        false_next=np.concatenate([np.where(false_leaf, false_ids + n_nodes, false_ids), np.zeros(n_leaves, np.int64)]),
        is_leaf=np.concatenate([np.zeros(n_nodes, bool), np.ones(n_leaves, bool)]),
        missing_true=np.concatenate([missing, np.zeros(n_leaves, bool)]),
        # a tree that is a single leaf: its root index names the leaf (as onnx.reference reads it)
        roots=np.where(degenerate, roots + n_nodes, roots),
        members=members,
        entry_start=np.concatenate([np.zeros(n_nodes, np.int64), np.arange(n_leaves)]),
        entry_count=np.concatenate([np.zeros(n_nodes, np.int64), np.ones(n_leaves, np.int64)]),
        entry_target=leaf_targets,
        entry_weight=leaf_weights,
        nan_follows_missing_only=False,
    )

    def run(x):
        dtype = x.dtype if x.dtype in (np.float16, np.float32, np.float64) else np.dtype(np.float32)
        return post(forest.scores(x, n_targets, aggregate, dtype)).astype(dtype, copy=False)

    return run


def _legacy_attribute(a: dict[str, Any], name: str):
    """A float list attribute or its `_as_tensor` twin (opset 3)."""
    tensor = a.get(name + "_as_tensor")
    if tensor is not None:
        return np.asarray(tensor).ravel()
    value = a.get(name)
    return None if value is None else np.asarray(value, dtype=np.float32)


def _legacy_forest(a: dict[str, Any], prefix: str) -> _Forest:
    """TreeEnsembleRegressor/Classifier attributes ((tree id, node id) addressing) as a _Forest."""
    tree_ids = np.asarray(a["nodes_treeids"], dtype=np.int64)
    node_ids = np.asarray(a["nodes_nodeids"], dtype=np.int64)
    modes_text = _texts(a["nodes_modes"])
    try:
        modes = np.asarray([-1 if m == "LEAF" else _MODE_CODES[m] for m in modes_text], dtype=np.int64)
    except KeyError as e:
        raise NotImplementedError(f"tree ensemble: node mode {e.args[0]!r} is not supported") from None
    if np.any(modes == _MEMBER):
        raise NotImplementedError("tree ensemble: BRANCH_MEMBER is only defined for TreeEnsemble (opset 5)")
    n = len(tree_ids)
    # global index of (tree, node) through a sorted composite key
    width = int(node_ids.max()) + 1 if n else 1
    key = tree_ids * width + node_ids
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]

    def locate(trees, nodes) -> np.ndarray:
        wanted = np.asarray(trees, dtype=np.int64) * width + np.asarray(nodes, dtype=np.int64)
        pos = np.minimum(np.searchsorted(sorted_key, wanted), max(n - 1, 0))
        if n == 0 or np.any(sorted_key[pos] != wanted):
            raise ValueError("tree ensemble: a node or target refers to a (tree, node) that does not exist")
        return order[pos]

    is_leaf = modes < 0
    true_next = np.zeros(n, dtype=np.int64)
    false_next = np.zeros(n, dtype=np.int64)
    branch = ~is_leaf
    true_next[branch] = locate(tree_ids[branch], np.asarray(a["nodes_truenodeids"], dtype=np.int64)[branch])
    false_next[branch] = locate(tree_ids[branch], np.asarray(a["nodes_falsenodeids"], dtype=np.int64)[branch])
    # the root of each tree is its first node in attribute order
    unique_trees, first = np.unique(tree_ids, return_index=True)
    missing = a.get("nodes_missing_value_tracks_true")
    missing = np.asarray(missing, dtype=bool) if missing else np.zeros(n, dtype=bool)

    entry_tree = np.asarray(a[prefix + "_treeids"], dtype=np.int64)
    entry_node = np.asarray(a[prefix + "_nodeids"], dtype=np.int64)
    entry_target = np.asarray(a[prefix + "_ids"], dtype=np.int64)
    entry_weight = _legacy_attribute(a, prefix + "_weights")
    owner = locate(entry_tree, entry_node) if len(entry_tree) else np.zeros(0, np.int64)
    by_owner = np.argsort(owner, kind="stable")
    entry_count = np.bincount(owner, minlength=n)
    entry_start = np.cumsum(entry_count) - entry_count
    values = _legacy_attribute(a, "nodes_values")
    return _Forest(
        feature=np.asarray(a["nodes_featureids"], dtype=np.int64),
        split=values if values is not None else np.zeros(n, np.float32),
        mode=np.where(is_leaf, 0, modes),
        true_next=true_next,
        false_next=false_next,
        is_leaf=is_leaf,
        missing_true=missing,
        roots=first[np.argsort(unique_trees)] if len(unique_trees) else np.zeros(0, np.int64),
        members={},
        entry_start=entry_start,
        entry_count=entry_count,
        entry_target=entry_target[by_owner],
        entry_weight=entry_weight[by_owner],
        nan_follows_missing_only=True,
    )


@kernel_builder("TreeEnsembleRegressor", 1, 3, domain=_ML)
def tree_ensemble_regressor(ctx: KernelContext):
    a = ctx.attributes
    forest = _legacy_forest(a, "target")
    n_targets = a.get("n_targets", 1)
    aggregate = _text(a.get("aggregate_function", "SUM"))
    base_values = _legacy_attribute(a, "base_values")
    post = _post_transform(_text(a.get("post_transform", "NONE")))

    def run(x):
        dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.dtype(np.float32)
        scores = forest.scores(x, n_targets, aggregate, dtype)
        if base_values is not None and base_values.size:
            scores = scores + base_values.astype(dtype).reshape(1, -1)
        return post(scores).astype(np.float32, copy=False)

    return run


@kernel_builder("TreeEnsembleClassifier", 1, 3, domain=_ML, multi_output=True)
def tree_ensemble_classifier(ctx: KernelContext):
    a = ctx.attributes
    forest = _legacy_forest(a, "class")
    int_labels = a.get("classlabels_int64s")
    text_labels = _texts(a.get("classlabels_strings") or [])
    labels = np.asarray(int_labels, dtype=np.int64) if int_labels else np.asarray(text_labels, dtype=object)
    if not len(labels):
        raise ValueError("TreeEnsembleClassifier: classlabels_int64s or classlabels_strings is required")
    n_classes = len(labels)
    class_ids = np.asarray(a["class_ids"], dtype=np.int64)
    binary = len(np.unique(class_ids)) == 1
    base_values = _legacy_attribute(a, "base_values")
    post_name = _text(a.get("post_transform", "NONE"))
    post = _post_transform(post_name)
    if n_classes == 1 and not (int_labels and int_labels[0] == 1):
        raise NotImplementedError(f"TreeEnsembleClassifier: a single class label {labels.tolist()} is not supported")

    def run(x):
        x = x.astype(np.float32, copy=False) if x.dtype not in (np.float32, np.float64) else x
        width = max(n_classes, int(class_ids.max()) + 1 if class_ids.size else 1)
        scores = forest.scores(x, width, "SUM", np.dtype(np.float32))[:, :n_classes]
        if base_values is not None and base_values.size:
            scores = scores + base_values.astype(np.float32).reshape(1, -1)
        if binary:
            # one score column (class_ids all equal): onnx.reference reads column 0 as the positive class
            positive = scores[:, 0]
            negative = 1 - positive if post_name in ("NONE", "PROBIT") else -positive
            scores = np.stack([negative, positive], axis=1).astype(np.float32)
        scores = post(scores).astype(np.float32, copy=False)
        index = np.argmax(scores, axis=1)
        if n_classes == 1:
            return np.where(index == 1, 1, 0).astype(np.int64), scores
        return labels[index], scores

    return run


# ----------------------------------------------------------------------------- support vector machines


class _SupportVectorKernel:
    """K(x, v) between every sample and every support vector, shape (N, V), in float64."""

    def __init__(self, kernel_type: Any, kernel_params: Any, support_vectors: np.ndarray):
        self.kind = _text(kernel_type or "LINEAR").upper()
        if self.kind not in ("LINEAR", "POLY", "RBF", "SIGMOID"):
            raise ValueError(f"SVM: kernel_type must be LINEAR, POLY, RBF or SIGMOID, got {self.kind!r}")
        params = list(kernel_params or [0.0, 0.0, 0.0])
        if len(params) != 3:
            raise ValueError(f"SVM: kernel_params holds gamma, coef0 and degree, got {len(params)} values")
        self.gamma, self.coef0, self.degree = float(params[0]), float(params[1]), int(params[2])
        self.vectors = support_vectors.astype(np.float64)
        self.squared_norms = np.square(self.vectors).sum(axis=1)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[1] != self.vectors.shape[1]:
            raise ValueError(f"SVM: X has {x.shape[1]} features but the support vectors have {self.vectors.shape[1]}")
        dot = x @ self.vectors.T
        if self.kind == "LINEAR":
            return dot
        if self.kind == "POLY":
            return np.power(self.gamma * dot + self.coef0, self.degree)
        if self.kind == "SIGMOID":
            return np.tanh(self.gamma * dot + self.coef0)
        distances = np.square(x).sum(axis=1, keepdims=True) - 2 * dot + self.squared_norms
        return np.exp(-self.gamma * np.maximum(distances, 0.0))


def _floats(values: Any) -> np.ndarray:
    return np.asarray(values if values is not None else [], dtype=np.float64)


@kernel_builder("SVMRegressor", 1, domain=_ML)
def svm_regressor(ctx: KernelContext):
    a = ctx.attributes
    coefficients = _floats(a.get("coefficients"))
    rho = _floats(a.get("rho"))
    n_supports = int(a.get("n_supports", 0))
    one_class = bool(a.get("one_class", 0))
    # post_transform is not applied: onnxruntime returns the decision value whatever it says
    bias = rho[0] if rho.size else 0.0
    if n_supports > 0:
        vectors = _floats(a.get("support_vectors")).reshape(n_supports, -1)
        if coefficients.size != n_supports:
            raise ValueError(f"SVMRegressor: {coefficients.size} coefficients for {n_supports} support vectors")
        gram = _SupportVectorKernel(a.get("kernel_type"), a.get("kernel_params"), vectors)
    else:
        # liblinear's form: no support vectors, one weight per feature
        gram = _SupportVectorKernel("LINEAR", None, coefficients.reshape(1, -1))
        coefficients = np.ones(1)

    def run(x):
        scores = gram(_as_rows(x).astype(np.float64)) @ coefficients + bias
        if one_class:
            scores = np.where(scores > 0, 1.0, -1.0)
        return scores.astype(np.float32).reshape(-1, 1)

    return run


def _pairwise_weights(coefficients: np.ndarray, vectors_per_class: np.ndarray) -> np.ndarray:
    """libsvm's one-vs-one coefficients as one (V, pairs) matrix: the decision value of
    pair (i, j) weighs class i's vectors by row j-1 and class j's vectors by row i."""
    n_classes, n_vectors = len(vectors_per_class), int(vectors_per_class.sum())
    rows = coefficients.reshape(n_classes - 1, n_vectors)
    starts = np.concatenate([[0], np.cumsum(vectors_per_class)[:-1]])
    pairs = [(i, j) for i in range(n_classes) for j in range(i + 1, n_classes)]
    weights = np.zeros((n_vectors, len(pairs)))
    for p, (i, j) in enumerate(pairs):
        own_i = slice(starts[i], starts[i] + vectors_per_class[i])
        own_j = slice(starts[j], starts[j] + vectors_per_class[j])
        weights[own_i, p] = rows[j - 1, own_i]
        weights[own_j, p] = rows[i, own_j]
    return weights


def _pairwise_probabilities(decisions: np.ndarray, prob_a: np.ndarray, prob_b: np.ndarray, n_classes: int) -> np.ndarray:
    """Class probabilities from one-vs-one decision values (N, pairs): Platt's sigmoid per
    pair, then the coupling of Wu, Lin and Weng (2004) that libsvm solves, for all samples
    at once (each stops iterating when it converges)."""
    f = decisions * prob_a + prob_b
    # 1 / (1 + exp(f)), written to overflow on neither side
    pair_probability = np.where(f >= 0, np.exp(-np.abs(f)) / (1 + np.exp(-np.abs(f))), 1 / (1 + np.exp(-np.abs(f))))
    pair_probability = np.clip(pair_probability, 1e-7, 1 - 1e-7)
    n = decisions.shape[0]
    r = np.zeros((n, n_classes, n_classes))
    upper_i, upper_j = np.triu_indices(n_classes, 1)  # the pairs' order: (0,1), (0,2), ..., (1,2), ...
    r[:, upper_i, upper_j] = pair_probability
    r[:, upper_j, upper_i] = 1 - pair_probability
    q = -r.transpose(0, 2, 1) * r
    diagonal = np.arange(n_classes)
    q[:, diagonal, diagonal] = np.square(r).sum(axis=1) - np.square(r[:, diagonal, diagonal])
    p = np.full((n, n_classes), 1.0 / n_classes)
    active = np.ones(n, dtype=bool)
    epsilon = 0.005 / n_classes
    for _ in range(max(100, n_classes)):
        qp = np.einsum("nij,nj->ni", q, p)
        pqp = (p * qp).sum(axis=1)
        active &= np.abs(qp - pqp[:, None]).max(axis=1) >= epsilon
        if not active.any():
            break
        rows = np.flatnonzero(active)
        qa, pa, qpa, pqpa = q[rows], p[rows], qp[rows], pqp[rows]
        for t in range(n_classes):
            diff = (pqpa - qpa[:, t]) / qa[:, t, t]
            pa[:, t] += diff
            scale = 1 + diff
            pqpa = (pqpa + diff * (diff * qa[:, t, t] + 2 * qpa[:, t])) / np.square(scale)
            pa /= scale[:, None]
            qpa = (qpa + diff[:, None] * qa[:, t, :]) / scale[:, None]
        p[rows] = pa
    return p


@kernel_builder("SVMClassifier", 1, domain=_ML, multi_output=True)
def svm_classifier(ctx: KernelContext):
    a = ctx.attributes
    int_labels = a.get("classlabels_ints")
    labels = np.asarray(int_labels, dtype=np.int64) if int_labels else np.asarray(_texts(a.get("classlabels_strings") or []), dtype=object)
    n_classes = len(labels)
    if n_classes < 2:
        raise ValueError("SVMClassifier: classlabels_ints or classlabels_strings must name at least two classes")
    coefficients = _floats(a.get("coefficients"))
    rho = _floats(a.get("rho"))
    prob_a, prob_b = _floats(a.get("prob_a")), _floats(a.get("prob_b"))
    vectors_per_class = np.asarray(a.get("vectors_per_class") or [], dtype=np.int64)
    post_name = _text(a.get("post_transform", "NONE"))
    post = _post_transform(post_name)
    n_vectors = int(vectors_per_class.sum())
    n_pairs = n_classes * (n_classes - 1) // 2
    all_positive = bool(coefficients.size) and bool(coefficients.min() >= 0)
    if n_vectors > 0:
        if len(vectors_per_class) != n_classes:
            raise ValueError(f"SVMClassifier: vectors_per_class has {len(vectors_per_class)} entries for {n_classes} classes")
        if rho.size != n_pairs:
            raise ValueError(f"SVMClassifier: {rho.size} rho values for {n_pairs} class pairs")
        vectors = _floats(a.get("support_vectors")).reshape(n_vectors, -1)
        gram = _SupportVectorKernel(a.get("kernel_type"), a.get("kernel_params"), vectors)
        weights = _pairwise_weights(coefficients, vectors_per_class)
        pair_i, pair_j = np.triu_indices(n_classes, 1)
    else:
        # liblinear's form: one weight row per class over the features, rho[0] added to all
        gram = _SupportVectorKernel("LINEAR", None, coefficients.reshape(n_classes, -1))
    with_probabilities = n_vectors > 0 and prob_a.size > 0

    def run_support_vectors(x):
        decisions = gram(x) @ weights + rho
        votes = np.zeros((x.shape[0], n_classes), dtype=np.int64)
        positive = decisions > 0
        np.add.at(votes, (slice(None), pair_i), positive)
        np.add.at(votes, (slice(None), pair_j), ~positive)
        index = np.argmax(votes, axis=1)
        if with_probabilities:
            return index, post(_pairwise_probabilities(decisions, prob_a, prob_b, n_classes).astype(np.float32))
        if n_classes == 2:
            # one decision value d, its sign's class the label; onnxruntime's scores are
            # (-d, d), through the logistic for LOGISTIC, and (1 - d, d) for both softmaxes
            d = decisions[:, 0].astype(np.float32)
            if post_name in ("SOFTMAX", "SOFTMAX_ZERO"):
                return index, np.stack([1 - d, d], axis=1)
            return index, post(np.stack([-d, d], axis=1))
        return index, post(decisions.astype(np.float32))

    def run_linear(x):
        scores = (gram(x) + (rho[0] if rho.size else 0.0)).astype(np.float32)
        index = np.argmax(scores, axis=1)
        if n_classes == 2:
            # onnxruntime's rule for two classes, on the scores before the post transform
            best = scores[np.arange(len(index)), index]
            second = (best >= 0.5) if all_positive else (best > 0)
            index = np.where(second, 1, index)
        return index, post(scores)

    def run(x):
        x = _as_rows(x).astype(np.float64)
        index, scores = run_support_vectors(x) if n_vectors > 0 else run_linear(x)
        return labels[index], scores.astype(np.float32, copy=False)

    return run


# ----------------------------------------------------------------------------- maps


@kernel_builder("ZipMap", 1, domain=_ML)
def zip_map(ctx: KernelContext):
    """One ``{label: probability}`` dict per row, as onnxruntime returns a
    ``seq(map(...))``: Python ints or strs for keys, Python floats for values."""
    a = ctx.attributes
    if a.get("classlabels_int64s"):
        labels: list[Any] = [int(v) for v in a["classlabels_int64s"]]
    elif a.get("classlabels_strings"):
        labels = _texts(a["classlabels_strings"])
    else:
        raise ValueError("ZipMap: classlabels_int64s or classlabels_strings is required")

    def run(x):
        rows = _as_rows(x)
        if rows.ndim != 2 or rows.shape[1] != len(labels):
            raise ValueError(f"ZipMap: X of shape {list(x.shape)} does not hold {len(labels)} columns, one per label")
        return [dict(zip(labels, row)) for row in rows.tolist()]

    return run


_MAP_VALUE_DTYPES = {
    onnx_tensor_type: np.dtype(dtype)
    for onnx_tensor_type, dtype in ((1, np.float32), (11, np.float64), (7, np.int64), (8, object))
}


def _declared_map_value_dtype(ctx: KernelContext, fallback: np.dtype) -> np.dtype:
    """The value dtype of the map a graph input declares (the loader keeps the type, which
    onnx_ir cannot hold, in the value's meta), else ``fallback``."""
    from plugrt.loader import DECLARED_TYPE_KEY

    value = ctx.node.inputs[0] if ctx.node is not None and ctx.node.inputs else None
    declared = value.meta.get(DECLARED_TYPE_KEY) if value is not None else None
    if declared is None or declared.WhichOneof("value") != "map_type":
        return fallback
    element = declared.map_type.value_type.tensor_type.elem_type
    return _MAP_VALUE_DTYPES.get(element, fallback)


@kernel_builder("DictVectorizer", 1, domain=_ML)
def dict_vectorizer(ctx: KernelContext):
    """A map as one dense row, shape (1, vocabulary): each key's value at its position in
    the vocabulary, zero (or "") for keys absent, keys outside the vocabulary ignored."""
    a = ctx.attributes
    vocabulary: list[Any] = _texts(a.get("string_vocabulary") or []) or [int(v) for v in a.get("int64_vocabulary") or []]
    if not vocabulary:
        raise ValueError("DictVectorizer: string_vocabulary or int64_vocabulary is required")
    position = {key: i for i, key in enumerate(vocabulary)}
    dtype = _declared_map_value_dtype(ctx, np.dtype(np.float32))

    def run(mapping):
        if not isinstance(mapping, dict):
            raise TypeError(f"DictVectorizer: the input must be a dict (a map), got {type(mapping).__name__}")
        out = np.full((1, len(vocabulary)), "" if dtype.kind == "O" else 0, dtype=dtype)
        hits = [(position[_text(k)], v) for k, v in mapping.items() if _text(k) in position]
        if hits:
            columns, values = zip(*hits)
            out[0, list(columns)] = values
        return out

    return run


@kernel_builder("CastMap", 1, domain=_ML)
def cast_map(ctx: KernelContext):
    """A map with int64 keys as one row, shape (1, N): its values in key order (DENSE), or
    at the index each key names, up to ``max_map`` (SPARSE), cast to float, int64 or str."""
    a = ctx.attributes
    cast_to = _text(a.get("cast_to", "TO_FLOAT"))
    dtypes: dict[str, np.dtype] = {"TO_FLOAT": np.dtype(np.float32), "TO_INT64": np.dtype(np.int64), "TO_STRING": np.dtype(object)}
    if cast_to not in dtypes:
        raise ValueError(f"CastMap: cast_to must be TO_FLOAT, TO_INT64 or TO_STRING, got {cast_to!r}")
    dtype: np.dtype = dtypes[cast_to]
    sparse = _text(a.get("map_form", "DENSE")) == "SPARSE"
    max_map = int(a.get("max_map", 1))

    def cast(values: list[Any]) -> np.ndarray:
        if dtype.kind == "O":
            # floats as C's "%f" writes them ("2.250000"), as onnxruntime does
            return np.asarray([v if isinstance(v, str) else f"{float(v):f}" for v in values], dtype=object)
        return np.asarray([float(v) for v in values]).astype(dtype)

    def run(mapping):
        if not isinstance(mapping, dict):
            raise TypeError(f"CastMap: the input must be a dict (a map), got {type(mapping).__name__}")
        keys = np.asarray(list(mapping.keys()), dtype=np.int64)
        values = cast(list(mapping.values()))
        if not sparse:
            return values[np.argsort(keys, kind="stable")].reshape(1, -1)
        # onnxruntime fills the absent string entries with "0.f"
        out = np.full((1, max_map), "0.f" if dtype.kind == "O" else 0, dtype=dtype)
        inside = (keys >= 0) & (keys < max_map)
        out[0, keys[inside]] = values[inside]
        return out

    return run
