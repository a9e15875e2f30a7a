"""String kernels (StringConcat, StringSplit, RegexFullMatch, StringNormalizer,
TfIdfVectorizer), checked against onnx.reference and plain Python string methods."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import reference_node, run_node
from plugrt.errors import PlugrtError


def _strings(values) -> np.ndarray:
    return np.array(values, dtype=object)


def test_string_concat_broadcasts_and_returns_python_strings():
    x = _strings([["a", "bb"], ["", "ç"]])
    y = _strings(["1", "22"])
    (got,) = run_node("StringConcat", {"x": x, "y": y}, 20)
    assert got.dtype == object and got.shape == (2, 2)
    assert got.tolist() == [["a1", "bb22"], ["1", "ç22"]]


@pytest.mark.parametrize("delimiter", [None, "", "-", "ab"])
@pytest.mark.parametrize("maxsplit", [None, 0, 1, 3])
def test_string_split_matches_python_split_with_padding(delimiter, maxsplit):
    x = _strings([["a-b--c", "  lead  and trail ", ""], ["xabyabz", "ab", "no delimiter"]])
    attributes = {k: v for k, v in {"delimiter": delimiter, "maxsplit": maxsplit}.items() if v is not None}
    pieces, counts = run_node("StringSplit", {"x": x}, 20, outputs=2, **attributes)
    expected = [[s.split(delimiter or None, -1 if maxsplit is None else maxsplit) for s in row] for row in x.tolist()]
    width = max(len(p) for row in expected for p in row)
    assert pieces.shape == (2, 3, width) and counts.dtype == np.int64
    assert counts.tolist() == [[len(p) for p in row] for row in expected]
    assert pieces.tolist() == [[p + [""] * (width - len(p)) for p in row] for row in expected]


def test_regex_full_match_keeps_the_input_shape():
    x = _strings([["abc@x.org", "abc@x.org.uk"], ["@x.org", "q@x.org"]])
    (got,) = run_node("RegexFullMatch", {"x": x}, 20, pattern=r"[a-z]+@x\.org")
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, [[True, False], [False, True]])


def test_regex_full_match_rejects_an_invalid_pattern():
    with pytest.raises(PlugrtError, match=r"pattern '\(' is not valid RE2 syntax"):
        run_node("RegexFullMatch", {"x": _strings(["a"])}, 20, pattern="(")


def test_string_normalizer_drops_stopword_elements_case_insensitively_then_lowers():
    x = _strings([["Monday", "tuesday", "MONDAY", "Wednesday"]])
    (got,) = run_node("StringNormalizer", {"x": x}, 10, stopwords=["monday"], case_change_action="LOWER")
    assert got.tolist() == [["tuesday", "wednesday"]]


def test_string_normalizer_case_sensitive_keeps_other_cases():
    x = _strings(["Monday", "monday", "Tuesday"])
    attributes = {"stopwords": ["monday"], "is_case_sensitive": 1, "case_change_action": "UPPER"}
    (got,) = run_node("StringNormalizer", {"x": x}, 10, **attributes)
    assert got.tolist() == ["MONDAY", "TUESDAY"]


@pytest.mark.parametrize(("shape", "expected_shape"), [((2,), (1,)), ((1, 2), (1, 1))])
def test_string_normalizer_with_everything_dropped_returns_one_empty_string(shape, expected_shape):
    x = _strings(["a", "A"]).reshape(shape)
    (got,) = run_node("StringNormalizer", {"x": x}, 10, stopwords=["a"])
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
    (got,) = run_node("TfIdfVectorizer", {"x": x}, 9, **attributes)
    if weighted:
        (expected,) = reference_node("TfIdfVectorizer", {"x": x}, 9, **attributes)
    else:
        # The reference cannot run IDF/TFIDF without weights; they default to all ones.
        (counts,) = reference_node("TfIdfVectorizer", {"x": x}, 9, **dict(attributes, mode="TF"))
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
    (got,) = run_node("TfIdfVectorizer", {"x": x}, 9, **attributes)
    (expected,) = reference_node("TfIdfVectorizer", {"x": x}, 9, **attributes)
    assert got.shape == (5,)
    np.testing.assert_array_equal(got, expected)
