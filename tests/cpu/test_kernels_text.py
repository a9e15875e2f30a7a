"""String kernels (StringConcat, StringSplit, RegexFullMatch, StringNormalizer,
TfIdfVectorizer), checked against onnx.reference and plain Python string methods."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import plugrt


def _element_type(value: np.ndarray) -> int:
    return onnx.TensorProto.STRING if value.dtype == object else helper.np_dtype_to_tensor_dtype(value.dtype)


def _model(op: str, opset: int, inputs: dict[str, np.ndarray], outputs: int = 1, **attributes) -> onnx.ModelProto:
    names = [f"y{i}" for i in range(outputs)]
    graph = helper.make_graph(
        [helper.make_node(op, list(inputs), names, **attributes)],
        "g",
        [
            helper.make_tensor_value_info(name, _element_type(value), value.shape)
            for name, value in inputs.items()
        ],
        [helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None) for name in names],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(op: str, opset: int, inputs: dict[str, np.ndarray], outputs: int = 1, **attributes) -> list[np.ndarray]:
    model = _model(op, opset, inputs, outputs, **attributes)
    return plugrt.InferenceSession(model.SerializeToString()).run(None, inputs)


def _reference(op: str, opset: int, inputs: dict[str, np.ndarray], outputs: int = 1, **attributes) -> list[np.ndarray]:
    return ReferenceEvaluator(_model(op, opset, inputs, outputs, **attributes)).run(None, inputs)


def _strings(values) -> np.ndarray:
    return np.array(values, dtype=object)


def test_string_concat_broadcasts_and_returns_python_strings():
    x = _strings([["a", "bb"], ["", "ç"]])
    y = _strings(["1", "22"])
    (got,) = _run("StringConcat", 20, {"x": x, "y": y})
    assert got.dtype == object and got.shape == (2, 2)
    assert got.tolist() == [["a1", "bb22"], ["1", "ç22"]]


@pytest.mark.parametrize("delimiter", [None, "", "-", "ab"])
@pytest.mark.parametrize("maxsplit", [None, 0, 1, 3])
def test_string_split_matches_python_split_with_padding(delimiter, maxsplit):
    x = _strings([["a-b--c", "  lead  and trail ", ""], ["xabyabz", "ab", "no delimiter"]])
    attributes = {k: v for k, v in {"delimiter": delimiter, "maxsplit": maxsplit}.items() if v is not None}
    pieces, counts = _run("StringSplit", 20, {"x": x}, outputs=2, **attributes)
    expected = [[s.split(delimiter or None, -1 if maxsplit is None else maxsplit) for s in row] for row in x.tolist()]
    width = max(len(p) for row in expected for p in row)
    assert pieces.shape == (2, 3, width) and counts.dtype == np.int64
    assert counts.tolist() == [[len(p) for p in row] for row in expected]
    assert pieces.tolist() == [[p + [""] * (width - len(p)) for p in row] for row in expected]


def test_regex_full_match_keeps_the_input_shape():
    x = _strings([["abc@x.org", "abc@x.org.uk"], ["@x.org", "q@x.org"]])
    (got,) = _run("RegexFullMatch", 20, {"x": x}, pattern=r"[a-z]+@x\.org")
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, [[True, False], [False, True]])


def test_regex_full_match_rejects_an_invalid_pattern():
    with pytest.raises(Exception, match="invalid pattern"):
        _run("RegexFullMatch", 20, {"x": _strings(["a"])}, pattern="(")


def test_string_normalizer_drops_stopword_elements_case_insensitively_then_lowers():
    x = _strings([["Monday", "tuesday", "MONDAY", "Wednesday"]])
    (got,) = _run("StringNormalizer", 10, {"x": x}, stopwords=["monday"], case_change_action="LOWER")
    assert got.tolist() == [["tuesday", "wednesday"]]


def test_string_normalizer_case_sensitive_keeps_other_cases():
    x = _strings(["Monday", "monday", "Tuesday"])
    attributes = {"stopwords": ["monday"], "is_case_sensitive": 1, "case_change_action": "UPPER"}
    (got,) = _run("StringNormalizer", 10, {"x": x}, **attributes)
    assert got.tolist() == ["MONDAY", "TUESDAY"]


@pytest.mark.parametrize(("shape", "expected_shape"), [((2,), (1,)), ((1, 2), (1, 1))])
def test_string_normalizer_with_everything_dropped_returns_one_empty_string(shape, expected_shape):
    x = _strings(["a", "A"]).reshape(shape)
    (got,) = _run("StringNormalizer", 10, {"x": x}, stopwords=["a"])
    assert got.shape == expected_shape and got.reshape(-1).tolist() == [""]


TFIDF_INT_POOL = {
    "ngram_counts": [0, 4, 8],
    "ngram_indexes": [7, 0, 1, 2, 3, 4, 5, 6, 8, 9],
    "pool_int64s": [2, 3, 5, 4, 5, 6, 7, 8, 6, 7, 6, 8, 5, 6],  # 4 unigrams, 2 bigrams, 2 trigrams
}


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize(("min_gram", "max_gram", "skips"), [(1, 1, 0), (1, 3, 0), (2, 3, 2), (1, 2, 3)])
@pytest.mark.parametrize("weighted", [False, True])
def test_tfidf_vectorizer_on_integers_matches_reference(mode, min_gram, max_gram, skips, weighted):
    x = np.random.default_rng(0).integers(2, 9, (3, 25)).astype(np.int32)
    attributes = dict(
        TFIDF_INT_POOL, mode=mode, min_gram_length=min_gram, max_gram_length=max_gram, max_skip_count=skips
    )
    if weighted:
        attributes["weights"] = [0.5 + i for i in range(10)]
    (got,) = _run("TfIdfVectorizer", 9, {"x": x}, **attributes)
    if weighted:
        (expected,) = _reference("TfIdfVectorizer", 9, {"x": x}, **attributes)
    else:
        # The reference cannot run IDF/TFIDF without weights; they default to all ones.
        (counts,) = _reference("TfIdfVectorizer", 9, {"x": x}, **dict(attributes, mode="TF"))
        expected = (counts > 0).astype(np.float32) if mode == "IDF" else counts
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_tfidf_vectorizer_on_strings_matches_reference_for_a_1d_input():
    rng = np.random.default_rng(1)
    words = ["the", "cat", "sat", "on", "mat", "a", "dog"]
    x = np.array([words[i] for i in rng.integers(0, 7, 40)], dtype=object)
    attributes = {
        "mode": "TF",
        "min_gram_length": 1,
        "max_gram_length": 2,
        "max_skip_count": 1,
        "ngram_counts": [0, 3],
        "ngram_indexes": [0, 1, 2, 3, 4],
        "pool_strings": ["cat", "dog", "unused", "the", "cat", "sat", "on"],
    }
    (got,) = _run("TfIdfVectorizer", 9, {"x": x}, **attributes)
    (expected,) = _reference("TfIdfVectorizer", 9, {"x": x}, **attributes)
    assert got.shape == (5,)
    np.testing.assert_array_equal(got, expected)
