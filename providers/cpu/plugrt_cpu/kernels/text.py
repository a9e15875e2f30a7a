"""String kernels: StringNormalizer, RegexFullMatch, StringSplit, StringConcat, TfIdfVectorizer.

Strings are numpy object arrays of Python ``str``. numpy has no vectorised path for
Python strings (``np.strings`` works on fixed-width ``U`` arrays, and converting there
and back costs as much as the operation), so element-wise string work goes through
``np.frompyfunc`` ufuncs: one C-level loop calling a Python function per element.
"""

from __future__ import annotations

import operator

import numpy as np

from .._registry import kernel, kernel_builder, KernelContext


def _object_result(values: object, shape: tuple[int, ...]) -> np.ndarray:
    """A frompyfunc result as an object array of ``shape`` (0-d results come back as scalars)."""
    out = np.empty(shape, dtype=object)
    out[...] = values
    return out


_concat = np.frompyfunc(operator.add, 2, 1)


@kernel("StringConcat", 20)
def string_concat(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    shape = np.broadcast_shapes(x.shape, y.shape)
    return _object_result(_concat(x.astype(object, copy=False), y.astype(object, copy=False)), shape)


def _re2_options():
    import re2  # google-re2: linear-time matching, the syntax the ONNX spec names

    options = re2.Options()
    options.log_errors = False  # the error is raised to the caller, not printed to stderr
    return re2, options


@kernel("RegexFullMatch", 20)
def regex_full_match(x: np.ndarray, *, pattern: str) -> np.ndarray:
    # The spec asks for RE2 semantics. Python's backtracking `re` takes exponential time on
    # patterns such as (a+)+$, so a tiny hostile model could hang the process: RE2 matches
    # in time linear in the input and rejects what it cannot match that way (backreferences,
    # lookaround).
    try:
        re2, options = _re2_options()
    except ImportError as e:
        raise ValueError(
            "RegexFullMatch needs the google-re2 package for RE2 semantics; pip install google-re2"
        ) from e
    try:
        regex = re2.compile(pattern, options)
    except re2.error as e:
        detail = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"RegexFullMatch: pattern {pattern!r} is not valid RE2 syntax: {detail}") from e
    match = np.frompyfunc(lambda s: regex.fullmatch(s) is not None, 1, 1)
    return np.asarray(match(x), dtype=np.bool_).reshape(x.shape)


@kernel("StringSplit", 20, multi_output=True)
def string_split(x: np.ndarray, *, delimiter: str = "", maxsplit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    # An unset or empty delimiter splits on runs of whitespace, as str.split(None) does.
    sep = delimiter or None
    limit = -1 if maxsplit is None else maxsplit
    pieces = np.frompyfunc(lambda s: s.split(sep, limit), 1, 1)(x) if x.size else np.empty(x.shape, dtype=object)
    pieces = _object_result(pieces, x.shape)
    counts = np.zeros(x.shape, np.int64)
    if x.size:
        counts[...] = np.frompyfunc(len, 1, 1)(pieces)
    width = int(counts.max(initial=0))
    out = np.full((*x.shape, width), "", dtype=object)
    flat_out = out.reshape(x.size, width)
    # Scatter every piece to (element, position) in one assignment.
    flat_counts = counts.reshape(-1)
    if width:
        rows = np.repeat(np.arange(flat_counts.size), flat_counts)
        cols = np.arange(rows.size) - np.repeat(np.cumsum(flat_counts) - flat_counts, flat_counts)
        flat_out[rows, cols] = np.fromiter(
            (piece for parts in pieces.reshape(-1) for piece in parts), dtype=object, count=rows.size
        )
    return out, counts


@kernel("StringNormalizer", 10)
def string_normalizer(
    x: np.ndarray,
    *,
    case_change_action: str = "NONE",
    is_case_sensitive: int = 0,
    locale: str = "",
    stopwords: list[str] | None = None,
) -> np.ndarray:
    # `locale` is accepted but Python's str.lower/upper are locale-independent Unicode case
    # mappings, which is what onnxruntime's default (en_US) locale gives as well.
    if case_change_action not in ("NONE", "LOWER", "UPPER"):
        raise ValueError(f"StringNormalizer: unknown case_change_action {case_change_action!r}")
    if x.ndim == 2 and x.shape[0] != 1 or x.ndim not in (1, 2):
        raise ValueError(f"StringNormalizer takes a [C] or [1, C] input, got shape {x.shape}")
    values = x.reshape(-1).astype(object, copy=False)
    if stopwords:
        if is_case_sensitive:
            drop = np.isin(values, np.array(stopwords, dtype=object))
        else:
            lowered = np.frompyfunc(str.lower, 1, 1)(values)
            drop = np.isin(lowered, np.array([w.lower() for w in stopwords], dtype=object))
        values = values[~drop]
    if case_change_action == "LOWER":
        values = np.frompyfunc(str.lower, 1, 1)(values)
    elif case_change_action == "UPPER":
        values = np.frompyfunc(str.upper, 1, 1)(values)
    if values.size == 0:
        values = np.array([""], dtype=object)
    return values.reshape(1, -1) if x.ndim == 2 else values


# ---------------------------------------------------------------------------
# TfIdfVectorizer
# ---------------------------------------------------------------------------


def _pool_ngrams(
    pool: list, vocab: np.ndarray, counts: list[int], indexes: list[int], lo: int, hi: int
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per n-gram length in [lo, hi]: (token ids [P, n], output column [P]) of the pool."""
    columns = np.asarray(indexes, dtype=np.int64)
    pool_ids = _token_ids(np.asarray(pool, dtype=vocab.dtype), vocab)
    grams: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    gram_number = 0  # n-grams are numbered across all lengths, in pool order
    for i, start in enumerate(counts):
        n = i + 1
        end = counts[i + 1] if i + 1 < len(counts) else len(pool)
        total = (end - start) // n
        if lo <= n <= hi and total:
            tokens = pool_ids[start : start + total * n].reshape(total, n)
            grams[n] = (tokens, columns[gram_number : gram_number + total])
        gram_number += total
    return grams


def _token_ids(tokens: np.ndarray, vocab: np.ndarray) -> np.ndarray:
    """Position of each token in the sorted vocabulary, or -1 when it is not there."""
    if vocab.size == 0:
        return np.full(tokens.shape, -1, dtype=np.int64)
    pos = np.searchsorted(vocab, tokens).clip(0, vocab.size - 1)
    return np.where(vocab[pos] == tokens, pos, -1)


@kernel_builder("TfIdfVectorizer", 9)
def tfidf_vectorizer(ctx: KernelContext):
    attrs = dict(ctx.attributes)
    mode = attrs.get("mode")
    if mode not in ("TF", "IDF", "TFIDF"):
        raise ValueError(f"TfIdfVectorizer: unknown mode {mode!r}; expected TF, IDF or TFIDF")
    for name in ("min_gram_length", "max_gram_length", "max_skip_count", "ngram_counts", "ngram_indexes"):
        if name not in attrs:
            raise ValueError(f"TfIdfVectorizer: attribute {name!r} is required")
    strings = bool(attrs.get("pool_strings"))
    if strings == bool(attrs.get("pool_int64s")):
        raise ValueError("TfIdfVectorizer: exactly one of pool_strings and pool_int64s must be set")
    pool = attrs["pool_strings"] if strings else attrs["pool_int64s"]
    lo, hi, skips = attrs["min_gram_length"], attrs["max_gram_length"], attrs["max_skip_count"]
    if lo > hi:
        raise ValueError(f"TfIdfVectorizer: min_gram_length {lo} exceeds max_gram_length {hi}")
    # Sorted vocabulary: strings as fixed-width unicode so searchsorted runs in C.
    vocab = np.unique(np.asarray(pool, dtype=str if strings else np.int64))
    grams = _pool_ngrams(pool, vocab, list(attrs["ngram_counts"]), attrs["ngram_indexes"], lo, hi)
    width = int(max(attrs["ngram_indexes"])) + 1
    weights = np.asarray(attrs.get("weights") or [], dtype=np.float32)

    def run(x: np.ndarray) -> np.ndarray:
        if x.ndim > 2:
            raise ValueError(f"TfIdfVectorizer takes a [C] or [N, C] input, got shape {x.shape}")
        rows = x.reshape(1 if x.ndim < 2 else x.shape[0], -1)
        ids = _token_ids(rows.astype(str) if strings else rows.astype(np.int64), vocab)
        num_rows, length = ids.shape
        counts = np.zeros((num_rows, width), dtype=np.int64)
        for n, (pool_grams, columns) in grams.items():
            # Unigrams are the same for every skip; longer n-grams are taken at each skip.
            for gap in range(1, (skips if n > 1 else 0) + 2):
                span = (n - 1) * gap
                if span >= length:
                    break
                starts = np.arange(length - span)
                windows = ids[:, starts[:, None] + gap * np.arange(n)].reshape(-1, n)
                # Match windows against the pool by uniquing both together.
                _, inverse = np.unique(np.concatenate([pool_grams, windows]), axis=0, return_inverse=True)
                inverse = inverse.reshape(-1)
                column_of = np.full(inverse.max() + 1, -1, dtype=np.int64)
                column_of[inverse[: len(pool_grams)]] = columns
                hit = column_of[inverse[len(pool_grams) :]]
                row = np.repeat(np.arange(num_rows), len(starts))
                found = hit >= 0
                np.add.at(counts, (row[found], hit[found]), 1)
        if mode == "TF":
            out: np.ndarray = counts.astype(np.float32)
        elif mode == "IDF":
            # onnxruntime (and onnx.reference) index weights by output column.
            out = np.where(counts > 0, weights[:width] if weights.size else np.float32(1), np.float32(0))
        else:
            out = counts * weights[:width] if weights.size else counts
        out = np.asarray(out, dtype=np.float32)
        return out.reshape(-1) if x.ndim < 2 else out

    return run
