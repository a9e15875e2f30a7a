"""scikit-learn, LightGBM and XGBoost models exported with skl2onnx's default options
(ZipMap on every classifier), run by plugrt and compared with onnxruntime and the
library's own predictions."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import numpy as np
import pytest

import plugrt

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("sklearn")
skl2onnx = pytest.importorskip("skl2onnx")

from sklearn.cluster import KMeans  # noqa: E402
from sklearn.compose import ColumnTransformer  # noqa: E402
from sklearn.ensemble import GradientBoostingClassifier, RandomForestClassifier, RandomForestRegressor  # noqa: E402
from sklearn.feature_extraction import DictVectorizer  # noqa: E402
from sklearn.linear_model import LinearRegression, LogisticRegression  # noqa: E402
from sklearn.pipeline import Pipeline, make_pipeline  # noqa: E402
from sklearn.preprocessing import OneHotEncoder, StandardScaler  # noqa: E402
from sklearn.svm import SVC, SVR  # noqa: E402

_RNG = np.random.default_rng(0)
_X = _RNG.standard_normal((60, 4)).astype(np.float32)
_THREE_CLASSES = (_X[:, 0] > 0).astype(np.int64) + (_X[:, 1] > 0.5)
_TWO_CLASSES = (_X[:, 0] + _X[:, 2] > 0).astype(np.int64)
_TARGET = (_X @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.1 * _RNG.standard_normal(60)).astype(np.float32)
_TEST = _X[:20]
# onnxmltools' tree converters need ai.onnx.ml 3 (skl2onnx refuses the 5 they would pick)
_BOOSTER_OPSET = {"": skl2onnx.get_latest_tested_opset_version(), "ai.onnx.ml": 3}


def _register_boosters(library: str) -> None:
    """skl2onnx's documented registration of onnxmltools' LightGBM / XGBoost converters."""
    pytest.importorskip(library)
    pytest.importorskip("onnxmltools")
    from skl2onnx import update_registered_converter
    from skl2onnx.common.shape_calculator import (
        calculate_linear_classifier_output_shapes,
        calculate_linear_regressor_output_shapes,
    )

    options = {"nocl": [True, False], "zipmap": [True, False, "columns"]}
    if library == "lightgbm":
        from lightgbm import LGBMClassifier, LGBMRegressor
        from onnxmltools.convert.lightgbm.operator_converters.LightGbm import convert_lightgbm

        update_registered_converter(LGBMClassifier, "LightGbmLGBMClassifier", calculate_linear_classifier_output_shapes, convert_lightgbm, options=options)
        update_registered_converter(LGBMRegressor, "LightGbmLGBMRegressor", calculate_linear_regressor_output_shapes, convert_lightgbm)
    else:
        from onnxmltools.convert.xgboost.operator_converters.XGBoost import convert_xgboost
        from xgboost import XGBClassifier

        update_registered_converter(XGBClassifier, "XGBoostXGBClassifier", calculate_linear_classifier_output_shapes, convert_xgboost, options=options)


def _lightgbm_classifier() -> Any:
    _register_boosters("lightgbm")
    from lightgbm import LGBMClassifier

    return LGBMClassifier(n_estimators=5, min_child_samples=3, verbose=-1)


def _xgboost_classifier() -> Any:
    _register_boosters("xgboost")
    from xgboost import XGBClassifier

    return XGBClassifier(n_estimators=5, max_depth=3)


def _lightgbm_regressor() -> Any:
    _register_boosters("lightgbm")
    from lightgbm import LGBMRegressor

    return LGBMRegressor(n_estimators=5, min_child_samples=3, verbose=-1)


_CLASSIFIERS: dict[str, tuple[Callable[[], Any], np.ndarray]] = {
    "logistic_regression": (LogisticRegression, _THREE_CLASSES),
    "random_forest": (lambda: RandomForestClassifier(n_estimators=5, max_depth=4, random_state=0), _THREE_CLASSES),
    "gradient_boosting": (lambda: GradientBoostingClassifier(n_estimators=5, random_state=0), _THREE_CLASSES),
    "gradient_boosting_binary": (lambda: GradientBoostingClassifier(n_estimators=5, random_state=0), _TWO_CLASSES),
    "svc": (SVC, _THREE_CLASSES),
    "svc_binary": (SVC, _TWO_CLASSES),
    "svc_probability": (lambda: SVC(probability=True, random_state=0), _THREE_CLASSES),
    "svc_probability_binary": (lambda: SVC(probability=True, random_state=0), _TWO_CLASSES),
    "svc_linear_kernel": (lambda: SVC(kernel="linear"), _THREE_CLASSES),
    "svc_poly_kernel": (lambda: SVC(kernel="poly"), _THREE_CLASSES),
    "svc_sigmoid_kernel": (lambda: SVC(kernel="sigmoid"), _THREE_CLASSES),
    "lightgbm": (_lightgbm_classifier, _THREE_CLASSES),
    "lightgbm_binary": (_lightgbm_classifier, _TWO_CLASSES),
    "xgboost": (_xgboost_classifier, _THREE_CLASSES),
    "xgboost_binary": (_xgboost_classifier, _TWO_CLASSES),
}

_REGRESSORS: dict[str, Callable[[], Any]] = {
    "svr": SVR,
    "linear_regression": LinearRegression,
    "random_forest": lambda: RandomForestRegressor(n_estimators=5, max_depth=4, random_state=0),
    "lightgbm": _lightgbm_regressor,
}


def _export(estimator: Any) -> bytes:
    opset = _BOOSTER_OPSET if type(estimator).__module__.split(".")[0] in ("lightgbm", "xgboost") else None
    return skl2onnx.to_onnx(estimator, _X[:1], target_opset=opset).SerializeToString()


@functools.lru_cache(maxsize=None)
def _classifier(name: str) -> tuple[Any, bytes]:
    make, labels = _CLASSIFIERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SVC(probability=True) is deprecated in scikit-learn 1.9
        estimator = make().fit(_X, labels)
        return estimator, _export(estimator)


@functools.lru_cache(maxsize=None)
def _regressor(name: str) -> tuple[Any, bytes]:
    estimator = _REGRESSORS[name]().fit(_X, _TARGET)
    return estimator, _export(estimator)


def _onnxruntime(model: bytes) -> Any:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def _assert_same_zip_map(got: list[dict], expected: list[dict]) -> None:
    """The same rows, keys (and key types) in the same order, values within 1e-5."""
    assert isinstance(got, list) and len(got) == len(expected)
    for row, want in zip(got, expected):
        assert list(row) == list(want)
        assert [type(k) for k in row] == [type(k) for k in want]
        assert all(type(v) is float for v in row.values())
        np.testing.assert_allclose(list(row.values()), list(want.values()), atol=1e-5)


@pytest.mark.parametrize("name", list(_CLASSIFIERS))
def test_classifier_labels_equal_onnxruntime_and_the_library(name):
    estimator, model = _classifier(name)
    labels, _ = plugrt.InferenceSession(model).run(None, {"X": _TEST})
    expected, _ = _onnxruntime(model).run(None, {"X": _TEST})
    assert labels.tolist() == expected.tolist()
    assert labels.tolist() == estimator.predict(_TEST).tolist()


@pytest.mark.parametrize("name", list(_CLASSIFIERS))
def test_classifier_zip_map_probabilities_match_onnxruntime(name):
    _, model = _classifier(name)
    _, probabilities = plugrt.InferenceSession(model).run(None, {"X": _TEST})
    _, expected = _onnxruntime(model).run(None, {"X": _TEST})
    _assert_same_zip_map(probabilities, expected)


@pytest.mark.parametrize("name", ["logistic_regression", "svc_probability", "lightgbm"])
def test_classifier_outputs_report_onnxruntime_types(name):
    _, model = _classifier(name)
    got = [(o.name, o.type, o.shape) for o in plugrt.InferenceSession(model).get_outputs()]
    assert got == [(o.name, o.type, o.shape) for o in _onnxruntime(model).get_outputs()]
    assert got[1][1] == "seq(map(int64,tensor(float)))"


def test_plugrt_load_returns_the_zip_map_of_onnxruntime():
    _, model = _classifier("random_forest")
    outputs = plugrt.load(model).run({"X": _TEST})
    _, expected = _onnxruntime(model).run(None, {"X": _TEST})
    _assert_same_zip_map(outputs["output_probability"], expected)


def test_svc_probabilities_match_scikit_learn():
    estimator, model = _classifier("svc_probability")
    _, probabilities = plugrt.InferenceSession(model).run(None, {"X": _TEST})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = estimator.predict_proba(_TEST)
    np.testing.assert_allclose([list(row.values()) for row in probabilities], expected, atol=1e-5)


def test_string_class_labels_key_the_zip_map_by_strings():
    labels = np.array(["cat", "dog", "fox"])[_THREE_CLASSES]
    model = skl2onnx.to_onnx(LogisticRegression().fit(_X, labels), _X[:1]).SerializeToString()
    got_labels, probabilities = plugrt.InferenceSession(model).run(None, {"X": _TEST})
    expected_labels, expected = _onnxruntime(model).run(None, {"X": _TEST})
    assert got_labels.tolist() == expected_labels.tolist()
    _assert_same_zip_map(probabilities, expected)
    assert set(probabilities[0]) == {"cat", "dog", "fox"}


@pytest.mark.parametrize("name", list(_REGRESSORS))
def test_regressor_matches_onnxruntime_and_the_library(name):
    estimator, model = _regressor(name)
    (got,) = plugrt.InferenceSession(model).run(None, {"X": _TEST})
    (expected,) = _onnxruntime(model).run(None, {"X": _TEST})
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-5)
    np.testing.assert_allclose(got.ravel(), estimator.predict(_TEST), rtol=1e-5, atol=1e-5)


def test_kmeans_labels_and_distances_match_onnxruntime():
    estimator = KMeans(n_clusters=3, n_init=2, random_state=0).fit(_X)
    model = skl2onnx.to_onnx(estimator, _X[:1]).SerializeToString()
    labels, distances = plugrt.InferenceSession(model).run(None, {"X": _TEST})
    expected_labels, expected_distances = _onnxruntime(model).run(None, {"X": _TEST})
    assert labels.tolist() == expected_labels.tolist() == estimator.predict(_TEST).tolist()
    np.testing.assert_allclose(distances, expected_distances, atol=1e-5)


def test_pipeline_with_a_column_transformer_over_strings_matches_onnxruntime():
    from skl2onnx.common.data_types import FloatTensorType, StringTensorType

    cities = _RNG.choice(["paris", "oslo", "rome"], (60, 1)).astype(object)
    sizes = _RNG.choice(["s", "m"], (60, 1)).astype(object)
    columns = {"city": cities, "size": sizes, "a": _X[:, :1], "b": _X[:, 1:2]}
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({name: values.ravel() for name, values in columns.items()})
    labels = (_X[:, 0] > 0).astype(np.int64) + (cities.ravel() == "oslo")
    prepare = ColumnTransformer(
        [("categories", OneHotEncoder(handle_unknown="ignore"), ["city", "size"]), ("numbers", StandardScaler(), ["a", "b"])]
    )
    pipeline = Pipeline([("prepare", prepare), ("classify", LogisticRegression())]).fit(frame, labels)
    initial_types = [
        ("city", StringTensorType([None, 1])), ("size", StringTensorType([None, 1])),
        ("a", FloatTensorType([None, 1])), ("b", FloatTensorType([None, 1])),
    ]
    model = skl2onnx.convert_sklearn(pipeline, initial_types=initial_types).SerializeToString()
    feeds = {name: values[:20] for name, values in columns.items()}
    got_labels, probabilities = plugrt.InferenceSession(model).run(None, feeds)
    expected_labels, expected = _onnxruntime(model).run(None, feeds)
    assert got_labels.tolist() == expected_labels.tolist() == pipeline.predict(frame[:20]).tolist()
    _assert_same_zip_map(probabilities, expected)


def test_dict_vectorizer_pipeline_takes_a_dict_as_onnxruntime():
    from skl2onnx.common.data_types import DictionaryType, FloatTensorType, StringTensorType

    rows = [{"a": 1.0, "b": 2.0}, {"b": 3.0, "c": 1.5}, {"a": 0.5, "c": 2.0}, {"a": 2.0}]
    pipeline = make_pipeline(DictVectorizer(sparse=False), LogisticRegression()).fit(rows, [0, 1, 1, 0])
    initial_types = [("input", DictionaryType(StringTensorType([1]), FloatTensorType([1])))]
    model = skl2onnx.convert_sklearn(pipeline, initial_types=initial_types).SerializeToString()
    session, reference = plugrt.InferenceSession(model), _onnxruntime(model)
    assert [i.type for i in session.get_inputs()] == [i.type for i in reference.get_inputs()] == ["map(string,tensor(float))"]
    for row in [*rows, {"a": 3.0, "unseen": 1.0}]:
        got_label, probabilities = session.run(None, {"input": row})
        expected_label, expected = reference.run(None, {"input": row})
        assert got_label.tolist() == expected_label.tolist()
        _assert_same_zip_map(probabilities, expected)


def test_the_optimized_model_file_declares_the_zip_map_type(tmp_path):
    _, model = _classifier("logistic_regression")
    options = plugrt.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    plugrt.InferenceSession(model, options)
    reloaded = plugrt.InferenceSession(options.optimized_model_filepath)
    assert [o.type for o in reloaded.get_outputs()] == ["tensor(int64)", "seq(map(int64,tensor(float)))"]
