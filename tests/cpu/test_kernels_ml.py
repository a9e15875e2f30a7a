"""ai.onnx.ml kernels (tree ensembles, encoders, linear models, scalers), checked against
onnx.reference and independently written numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from helpers import node_case, run_model

_FLOAT, _INT64, _STRING = TensorProto.FLOAT, TensorProto.INT64, TensorProto.STRING


def _assert_matches_reference(model, feeds, rtol=1e-5):
    expected = ReferenceEvaluator(model).run(None, feeds)
    got = run_model(model, feeds)
    for g, e in zip(got, expected):
        e = np.asarray(e)
        if e.dtype.kind == "U":
            e = e.astype(object)
        assert g.dtype == e.dtype
        assert g.shape == e.shape
        if e.dtype == object:
            assert g.tolist() == e.tolist()
        else:
            np.testing.assert_allclose(g, e, rtol=rtol, atol=1e-6)


# ----------------------------------------------------------------------------- TreeEnsemble (opset 5)


def _random_tree_ensemble(rng, n_trees, n_features, n_targets, dtype, with_members):
    """TreeEnsemble attributes for random trees (nodes in depth-first pre-order)."""
    keys = ("featureids", "splits", "modes", "truenodeids", "falsenodeids", "trueleafs", "falseleafs", "missing")
    nodes = {k: [] for k in keys}
    leaf_targets, leaf_weights, members, roots = [], [], [], []

    def add_leaf():
        leaf_targets.append(int(rng.integers(n_targets)))
        leaf_weights.append(float(rng.standard_normal()))
        return len(leaf_targets) - 1

    def add_node(depth):
        index = len(nodes["modes"])
        for k in keys:
            nodes[k].append(0)
        mode = int(rng.integers(0, 7 if with_members else 6))
        nodes["modes"][index] = mode
        nodes["featureids"][index] = int(rng.integers(n_features))
        nodes["splits"][index] = float(np.round(rng.standard_normal(), 1)) if mode != 6 else np.nan
        nodes["missing"][index] = int(rng.integers(2))
        if mode == 6:
            # onnx.reference stops reading a set at a 0.0 member, so avoid that value
            values = np.round(rng.standard_normal(int(rng.integers(1, 4))), 1)
            members.extend([v if v != 0 else 0.5 for v in values] + [np.nan])
        for side in ("true", "false"):
            if depth >= 3 or rng.random() < 0.3:
                nodes[side + "leafs"][index], nodes[side + "nodeids"][index] = 1, add_leaf()
            else:
                nodes[side + "leafs"][index], nodes[side + "nodeids"][index] = 0, add_node(depth + 1)
        return index

    for _ in range(n_trees):
        roots.append(add_node(0))
    attrs = {
        "nodes_featureids": nodes["featureids"],
        "nodes_splits": numpy_helper.from_array(np.array(nodes["splits"], dtype=dtype)),
        "nodes_modes": numpy_helper.from_array(np.array(nodes["modes"], dtype=np.uint8)),
        "nodes_truenodeids": nodes["truenodeids"],
        "nodes_falsenodeids": nodes["falsenodeids"],
        "nodes_trueleafs": nodes["trueleafs"],
        "nodes_falseleafs": nodes["falseleafs"],
        "nodes_missing_value_tracks_true": nodes["missing"],
        "leaf_targetids": leaf_targets,
        "leaf_weights": numpy_helper.from_array(np.array(leaf_weights, dtype=dtype)),
        "tree_roots": roots,
        "n_targets": n_targets,
    }
    if members:
        attrs["membership_values"] = numpy_helper.from_array(np.array(members, dtype=dtype))
    return attrs


def _features(rng, n, n_features, dtype):
    x = np.round(rng.standard_normal((n, n_features)), 1).astype(dtype)
    x[rng.integers(0, n, 6), rng.integers(0, n_features, 6)] = np.nan
    return x


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("aggregate_function", [0, 1, 2, 3], ids=["average", "sum", "min", "max"])
def test_tree_ensemble_matches_reference(seed, dtype, aggregate_function):
    rng = np.random.default_rng(seed)
    attrs = _random_tree_ensemble(rng, 5, 3, 3, dtype, with_members=seed % 2 == 0)
    x = _features(rng, 40, 3, dtype)
    model, feeds = node_case("TreeEnsemble", [x], 19, domain="ai.onnx.ml", domain_opset=5, output_types=[helper.np_dtype_to_tensor_dtype(np.dtype(dtype))], ir_version=10, attributes=dict(attrs, aggregate_function=aggregate_function))
    _assert_matches_reference(model, feeds)


def test_tree_ensemble_applies_its_post_transform():
    # onnx.reference ignores post_transform; the spec (and onnxruntime) apply it
    rng = np.random.default_rng(7)
    attrs = _random_tree_ensemble(rng, 4, 3, 2, np.float32, with_members=False)
    x = _features(rng, 20, 3, np.float32)
    output = [_FLOAT]
    raw_model, feeds = node_case("TreeEnsemble", [x], 19, domain="ai.onnx.ml", domain_opset=5, output_types=output, ir_version=10, attributes=attrs)
    (raw,) = run_model(raw_model, feeds)
    logistic_model, _ = node_case("TreeEnsemble", [x], 19, domain="ai.onnx.ml", domain_opset=5, output_types=output, ir_version=10, attributes=dict(attrs, post_transform=2))
    (got,) = run_model(logistic_model, feeds)
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-raw.astype(np.float64))), rtol=1e-6)


# ----------------------------------------------------------------------------- TreeEnsembleRegressor / Classifier


def _random_legacy_trees(rng, n_trees, n_targets, prefix):
    attrs = {k: [] for k in ("nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_modes", "nodes_values",
                             "nodes_truenodeids", "nodes_falsenodeids", "nodes_missing_value_tracks_true")}
    for k in ("_treeids", "_nodeids", "_ids", "_weights"):
        attrs[prefix + k] = []
    modes = ["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ"]
    for tree in range(n_trees):
        counter = iter(range(1000))

        def emit(depth, tree=tree, counter=counter):
            node_id = next(counter)
            row = len(attrs["nodes_treeids"])
            for k in list(attrs)[:8]:
                attrs[k].append(0)
            attrs["nodes_treeids"][row], attrs["nodes_nodeids"][row] = tree, node_id
            if depth >= 3 or (depth > 0 and rng.random() < 0.3):
                attrs["nodes_modes"][row] = "LEAF"
                for _ in range(int(rng.integers(1, 3))):  # a leaf may feed several targets
                    attrs[prefix + "_treeids"].append(tree)
                    attrs[prefix + "_nodeids"].append(node_id)
                    attrs[prefix + "_ids"].append(int(rng.integers(n_targets)))
                    attrs[prefix + "_weights"].append(float(rng.standard_normal()))
                return node_id
            attrs["nodes_modes"][row] = modes[int(rng.integers(len(modes)))]
            attrs["nodes_featureids"][row] = int(rng.integers(3))
            attrs["nodes_values"][row] = float(np.round(rng.standard_normal(), 1))
            attrs["nodes_missing_value_tracks_true"][row] = int(rng.integers(2))
            attrs["nodes_truenodeids"][row] = emit(depth + 1)
            attrs["nodes_falsenodeids"][row] = emit(depth + 1)
            return node_id

        emit(0)
    return attrs


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("aggregate_function", ["SUM", "AVERAGE", "MIN", "MAX"])
def test_tree_ensemble_regressor_matches_reference(seed, aggregate_function):
    rng = np.random.default_rng(seed)
    attrs = _random_legacy_trees(rng, 4, 3, "target")
    attrs.update(n_targets=3, aggregate_function=aggregate_function, base_values=[0.1, 0.2, 0.3])
    model, feeds = node_case("TreeEnsembleRegressor", [_features(rng, 40, 3, np.float32)], 19, domain="ai.onnx.ml", domain_opset=3, output_types=[_FLOAT], ir_version=10, attributes=attrs)
    _assert_matches_reference(model, feeds)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n_classes", [1, 2, 3])
@pytest.mark.parametrize("post_transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("string_labels", [False, True])
def test_tree_ensemble_classifier_matches_reference(seed, n_classes, post_transform, string_labels):
    rng = np.random.default_rng(seed)
    attrs = _random_legacy_trees(rng, 3, n_classes, "class")
    labels = max(n_classes, 2)
    if string_labels:
        attrs["classlabels_strings"] = [f"c{k}" for k in range(labels)]
    else:
        attrs["classlabels_int64s"] = list(range(10, 10 + labels))
    attrs["post_transform"] = post_transform
    outputs = [_STRING if string_labels else _INT64, _FLOAT]
    model, feeds = node_case("TreeEnsembleClassifier", [_features(rng, 40, 3, np.float32)], 19, domain="ai.onnx.ml", domain_opset=3, output_types=outputs, ir_version=10, attributes=attrs)
    _assert_matches_reference(model, feeds)


# ----------------------------------------------------------------------------- encoders


def test_label_encoder_maps_floats_to_strings_with_a_default():
    x = np.array([1.5, 2.5, np.nan, 7.0, 1.5], dtype=np.float32)
    attrs = {"keys_floats": [1.5, 7.0], "values_strings": ["a", "b"], "default_string": "?"}
    model, feeds = node_case("LabelEncoder", [x], 19, domain="ai.onnx.ml", domain_opset=2, output_types=[_STRING], ir_version=10, attributes=attrs)
    (got,) = run_model(model, feeds)
    assert got.tolist() == ["a", "?", "?", "b", "a"]


def test_label_encoder_last_duplicate_key_wins():
    x = np.array([[0, 3], [1, 9]], dtype=np.int64)
    attrs = {"keys_int64s": [0, 3, 3, 1], "values_floats": [0.5, 3.5, 4.5, 1.5]}
    model, feeds = node_case("LabelEncoder", [x], 19, domain="ai.onnx.ml", domain_opset=2, output_types=[_FLOAT], ir_version=10, attributes=attrs)
    _assert_matches_reference(model, feeds)


def test_label_encoder_v4_tensor_values_without_default_use_the_type_default():
    x = np.array([1.5, 2.0, 3.25], dtype=np.float64)
    attrs = {
        "keys_tensor": numpy_helper.from_array(np.array([2.0, 3.25])),
        "values_tensor": numpy_helper.from_array(np.array([7, 8], dtype=np.int32)),
    }
    model, feeds = node_case("LabelEncoder", [x], 19, domain="ai.onnx.ml", domain_opset=4, output_types=[TensorProto.INT32], ir_version=10, attributes=attrs)
    (got,) = run_model(model, feeds)
    assert got.dtype == np.int32
    assert got.tolist() == [-1, 7, 8]


def test_label_encoder_v1_maps_strings_to_class_indices_and_back():
    classes = {"classes_strings": ["a", "b", "c"], "default_string": "none"}
    model, feeds = node_case("LabelEncoder", [np.array(["c", "q", "a"], dtype=object)], 19, domain="ai.onnx.ml", domain_opset=1, output_types=[_INT64], ir_version=10, attributes=classes)
    assert run_model(model, feeds)[0].tolist() == [2, -1, 0]
    model, feeds = node_case("LabelEncoder", [np.array([1, 7], dtype=np.int64)], 19, domain="ai.onnx.ml", domain_opset=1, output_types=[_STRING], ir_version=10, attributes=classes)
    assert run_model(model, feeds)[0].tolist() == ["b", "none"]


def test_category_mapper_maps_both_ways():
    cats = {"cats_strings": ["a", "b"], "cats_int64s": [5, 9], "default_int64": -7, "default_string": "?"}
    model, feeds = node_case("CategoryMapper", [np.array([["b", "x"]], dtype=object)], 19, domain="ai.onnx.ml", output_types=[_INT64], ir_version=10, attributes=cats)
    assert run_model(model, feeds)[0].tolist() == [[9, -7]]
    model, feeds = node_case("CategoryMapper", [np.array([5, 6], dtype=np.int64)], 19, domain="ai.onnx.ml", output_types=[_STRING], ir_version=10, attributes=cats)
    assert run_model(model, feeds)[0].tolist() == ["a", "?"]


@pytest.mark.parametrize(
    ("x", "attrs"),
    [
        (np.array([[0, 4, 7], [3, 9, 1]], dtype=np.int64), {"cats_int64s": [0, 1, 3, 4, 7]}),
        (np.array([["a", "b", "z"]], dtype=object), {"cats_strings": ["a", "b", "c"]}),
    ],
)
def test_one_hot_encoder_matches_reference(x, attrs):
    model, feeds = node_case("OneHotEncoder", [x], 19, domain="ai.onnx.ml", output_types=[_FLOAT], ir_version=10, attributes=attrs)
    _assert_matches_reference(model, feeds)


def test_one_hot_encoder_rejects_unknown_categories_when_zeros_is_0():
    model, feeds = node_case("OneHotEncoder", [np.array([1, 5], dtype=np.int64)], 19, domain="ai.onnx.ml", output_types=[_FLOAT], ir_version=10, attributes={"cats_int64s": [1, 2], "zeros": 0})
    with pytest.raises(Exception, match="categor"):
        run_model(model, feeds)


# ----------------------------------------------------------------------------- simple transforms and linear models

_X = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
def test_normalizer_matches_reference(norm):
    model, feeds = node_case("Normalizer", [_X], 19, domain="ai.onnx.ml", output_types=[_FLOAT], ir_version=10, attributes={"norm": norm})
    _assert_matches_reference(model, feeds)


def test_scaler_subtracts_offset_then_scales():
    attrs = {"offset": [0.1, 0.2, 0.3, 0.4], "scale": [2.0, 3.0, 4.0, 5.0]}
    model, feeds = node_case("Scaler", [_X], 19, domain="ai.onnx.ml", output_types=[_FLOAT], ir_version=10, attributes=attrs)
    (got,) = run_model(model, feeds)
    expected = (_X - np.array(attrs["offset"], np.float32)) * np.array(attrs["scale"], np.float32)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_imputer_replaces_nan_per_feature():
    x = _X.copy()
    x[1, 2] = x[3, 0] = np.nan
    model, feeds = node_case("Imputer", [x], 19, domain="ai.onnx.ml", output_types=[_FLOAT], ir_version=10, attributes={"imputed_value_floats": [1.0, 2.0, 3.0, 4.0], "replaced_value_float": np.nan})
    _assert_matches_reference(model, feeds)


def test_array_feature_extractor_on_a_vector_returns_one_row():
    model, feeds = node_case("ArrayFeatureExtractor", [_X[0], np.array([2, 0])], 19, domain="ai.onnx.ml", output_types=[_FLOAT], ir_version=10, attributes={})
    _assert_matches_reference(model, feeds)


def test_linear_regressor_matches_reference():
    coefficients = np.random.default_rng(1).standard_normal(8).tolist()
    attrs = {"coefficients": coefficients, "intercepts": [0.5, -1.0], "targets": 2}
    model, feeds = node_case("LinearRegressor", [_X], 19, domain="ai.onnx.ml", output_types=[_FLOAT], ir_version=10, attributes=attrs)
    _assert_matches_reference(model, feeds)


@pytest.mark.parametrize("post_transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("n_classes", [1, 3])
def test_linear_classifier_matches_reference(post_transform, n_classes):
    rng = np.random.default_rng(2)
    attrs = {
        "coefficients": rng.standard_normal(4 * n_classes).tolist(),
        "intercepts": rng.standard_normal(n_classes).tolist(),
        "classlabels_ints": list(range(max(n_classes, 2))),
        "post_transform": post_transform,
    }
    model, feeds = node_case("LinearClassifier", [_X], 19, domain="ai.onnx.ml", output_types=[_INT64, _FLOAT], ir_version=10, attributes=attrs)
    _assert_matches_reference(model, feeds)


# ----------------------------------------------------------------------------- SVMs (against onnxruntime)


def _assert_matches_onnxruntime(model, feeds, atol=1e-5):
    ort = pytest.importorskip("onnxruntime")
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = run_model(model, feeds)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        if e.dtype.kind in "iuO":
            assert g.tolist() == e.tolist()
        else:
            assert g.dtype == e.dtype
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=atol)


_SVM_X = np.random.default_rng(7).standard_normal((30, 3)).astype(np.float32)


def _svm_classifier_attributes(rng, n_classes, kernel_type, probabilities):
    per_class = rng.integers(1, 4, n_classes).tolist()
    n_vectors, n_pairs = sum(per_class), n_classes * (n_classes - 1) // 2
    attrs = {
        "classlabels_ints": list(range(5, 5 + n_classes)),
        "coefficients": rng.standard_normal((n_classes - 1) * n_vectors).tolist(),
        "kernel_params": [0.3, 0.1, 3.0],
        "kernel_type": kernel_type,
        "rho": rng.standard_normal(n_pairs).tolist(),
        "support_vectors": rng.standard_normal(n_vectors * 3).tolist(),
        "vectors_per_class": per_class,
    }
    if probabilities:
        attrs["prob_a"] = (-2 * rng.random(n_pairs)).tolist()
        attrs["prob_b"] = rng.standard_normal(n_pairs).tolist()
    return attrs


def _svm_classifier_case(attrs, label_type=_INT64):
    return node_case("SVMClassifier", [_SVM_X], 17, domain="ai.onnx.ml", output_types=[label_type, _FLOAT], attributes=attrs)


@pytest.mark.parametrize("kernel_type", ["LINEAR", "POLY", "RBF", "SIGMOID"])
@pytest.mark.parametrize("n_classes", [2, 3, 4])
def test_svm_classifier_one_vs_one_votes_match_onnxruntime(kernel_type, n_classes):
    attrs = _svm_classifier_attributes(np.random.default_rng(n_classes), n_classes, kernel_type, probabilities=False)
    _assert_matches_onnxruntime(*_svm_classifier_case(attrs))


@pytest.mark.parametrize("kernel_type", ["LINEAR", "RBF"])
@pytest.mark.parametrize("n_classes", [2, 3, 4])
def test_svm_classifier_probabilities_match_onnxruntime(kernel_type, n_classes):
    attrs = _svm_classifier_attributes(np.random.default_rng(10 + n_classes), n_classes, kernel_type, probabilities=True)
    _assert_matches_onnxruntime(*_svm_classifier_case(attrs))


@pytest.mark.parametrize("post_transform", ["LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("n_classes", [2, 3])
def test_svm_classifier_applies_post_transforms_as_onnxruntime(post_transform, n_classes):
    attrs = _svm_classifier_attributes(np.random.default_rng(20 + n_classes), n_classes, "RBF", probabilities=False)
    _assert_matches_onnxruntime(*_svm_classifier_case(dict(attrs, post_transform=post_transform)))


def test_svm_classifier_with_string_labels_returns_strings():
    attrs = _svm_classifier_attributes(np.random.default_rng(30), 3, "RBF", probabilities=True)
    del attrs["classlabels_ints"]
    attrs["classlabels_strings"] = ["cat", "dog", "fox"]
    _assert_matches_onnxruntime(*_svm_classifier_case(attrs, label_type=_STRING))


@pytest.mark.parametrize("positive_weights", [False, True])
@pytest.mark.parametrize("n_classes", [2, 3])
def test_svm_classifier_without_support_vectors_is_linear_as_onnxruntime(positive_weights, n_classes):
    weights = np.random.default_rng(40 + n_classes).standard_normal(n_classes * 3)
    attrs = {
        "classlabels_ints": list(range(n_classes)),
        "coefficients": (np.abs(weights) if positive_weights else weights).tolist(),
        "kernel_params": [0.3, 0.1, 3.0],
        "kernel_type": "LINEAR",
        "rho": [0.3],
    }
    _assert_matches_onnxruntime(*_svm_classifier_case(attrs))


@pytest.mark.parametrize("kernel_type", ["LINEAR", "POLY", "RBF", "SIGMOID"])
@pytest.mark.parametrize("one_class", [0, 1])
def test_svm_regressor_matches_onnxruntime(kernel_type, one_class):
    rng = np.random.default_rng(50)
    attrs = {
        "coefficients": rng.standard_normal(4).tolist(),
        "kernel_params": [0.3, 0.1, 3.0],
        "kernel_type": kernel_type,
        "n_supports": 4,
        "one_class": one_class,
        "rho": [0.2],
        "support_vectors": rng.standard_normal(12).tolist(),
    }
    _assert_matches_onnxruntime(*node_case("SVMRegressor", [_SVM_X], 17, domain="ai.onnx.ml", output_types=[_FLOAT], attributes=attrs))


def test_svm_regressor_without_support_vectors_is_linear():
    attrs = {"coefficients": [0.5, -1.0, 2.0], "rho": [0.25], "n_supports": 0}
    model, feeds = node_case("SVMRegressor", [_SVM_X], 17, domain="ai.onnx.ml", output_types=[_FLOAT], attributes=attrs)
    (got,) = run_model(model, feeds)
    # an independent numpy form of the same linear model
    np.testing.assert_allclose(got.ravel(), _SVM_X @ np.array([0.5, -1.0, 2.0]) + 0.25, rtol=1e-6)


def test_svm_regressor_ignores_post_transform_as_onnxruntime():
    rng = np.random.default_rng(51)
    attrs = {
        "coefficients": rng.standard_normal(4).tolist(), "kernel_type": "RBF", "kernel_params": [0.3, 0.0, 0.0],
        "n_supports": 4, "rho": [0.2], "support_vectors": rng.standard_normal(12).tolist(), "post_transform": "LOGISTIC",
    }
    _assert_matches_onnxruntime(*node_case("SVMRegressor", [_SVM_X], 17, domain="ai.onnx.ml", output_types=[_FLOAT], attributes=attrs))


# ----------------------------------------------------------------------------- maps


def _map_model(op_type, input_type, output_type, **attrs):
    node = helper.make_node(op_type, ["x"], ["y"], domain="ai.onnx.ml", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_value_info("x", input_type)], [helper.make_value_info("y", output_type)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)])


def test_zip_map_returns_one_dict_per_row_keyed_by_int_labels():
    model = _map_model(
        "ZipMap", helper.make_tensor_type_proto(_FLOAT, [None, 3]),
        helper.make_sequence_type_proto(helper.make_map_type_proto(_INT64, helper.make_tensor_type_proto(_FLOAT, []))),
        classlabels_int64s=[3, 1, 7],
    )
    x = np.array([[0.25, 0.5, 0.25], [0.0, 1.0, 0.0]], dtype=np.float32)
    (got,) = run_model(model, {"x": x})
    assert got == [{3: 0.25, 1: 0.5, 7: 0.25}, {3: 0.0, 1: 1.0, 7: 0.0}]
    assert all(type(key) is int and type(value) is float for row in got for key, value in row.items())


def test_zip_map_keys_by_string_labels():
    model = _map_model(
        "ZipMap", helper.make_tensor_type_proto(_FLOAT, [None, 2]),
        helper.make_sequence_type_proto(helper.make_map_type_proto(_STRING, helper.make_tensor_type_proto(_FLOAT, []))),
        classlabels_strings=["no", "yes"],
    )
    (got,) = run_model(model, {"x": np.array([[0.75, 0.25]], dtype=np.float32)})
    assert got == [{"no": 0.75, "yes": 0.25}]


def test_dict_vectorizer_places_each_key_at_its_vocabulary_position():
    model = _map_model(
        "DictVectorizer", helper.make_map_type_proto(_STRING, helper.make_tensor_type_proto(TensorProto.DOUBLE, [])),
        helper.make_tensor_type_proto(TensorProto.DOUBLE, [1, 3]), string_vocabulary=["a", "b", "c"],
    )
    (got,) = run_model(model, {"x": {"c": 2.5, "a": 1.0, "unknown": 9.0}})
    assert got.dtype == np.float64  # the map's declared value type
    assert got.tolist() == [[1.0, 0.0, 2.5]]


@pytest.mark.parametrize(
    ("map_form", "cast_to", "expected"),
    [
        ("DENSE", "TO_FLOAT", [[2.25, -1.0, 1.5]]),
        ("SPARSE", "TO_FLOAT", [[2.25, -1.0, 0.0, 1.5, 0.0]]),
        ("DENSE", "TO_INT64", [[2, -1, 1]]),
        ("SPARSE", "TO_STRING", [["2.250000", "-1.000000", "0.f", "1.500000", "0.f"]]),  # as onnxruntime writes them
    ],
)
def test_cast_map_lays_out_a_map_as_onnxruntime(map_form, cast_to, expected):
    element = {"TO_FLOAT": _FLOAT, "TO_INT64": _INT64, "TO_STRING": _STRING}[cast_to]
    model = _map_model(
        "CastMap", helper.make_map_type_proto(_INT64, helper.make_tensor_type_proto(_FLOAT, [])),
        helper.make_tensor_type_proto(element, None), cast_to=cast_to, map_form=map_form, max_map=5,
    )
    (got,) = run_model(model, {"x": {3: 1.5, 0: 2.25, 1: -1.0}})
    assert got.tolist() == expected
