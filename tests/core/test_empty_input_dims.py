"""A symbolic dimension shared by inputs: an input empty along it may disagree (as onnxruntime
runs optimum's merged decoders), a nonzero disagreement is still refused."""

from __future__ import annotations

import numpy as np
import pytest

import plugrt
from plugrt.errors import SymbolConflictError

from helpers import model_bytes

# the shape of optimum's merged decoder: the cached branch reads `past`, the first step
# feeds it empty and takes the other branch
MERGED = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[B, E, 4] enc, float[B, E, 4] past, bool use_cache) => (float[B, M, 4] out) {
        out = If (use_cache) <
            then_branch = t () => (float[B, M, 4] joined) { joined = Concat <axis = 1> (past, enc) },
            else_branch = e () => (float[B, M, 4] plain) { plain = Identity (enc) }
        >
    }
    """
)
ENC = np.arange(24, dtype=np.float32).reshape(1, 6, 4)


def test_an_empty_input_may_disagree_on_a_shared_dimension():
    ort = pytest.importorskip("onnxruntime")
    feeds = {"enc": ENC, "past": np.zeros((1, 0, 4), np.float32), "use_cache": np.array(False)}
    expected = ort.InferenceSession(MERGED, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    ours = plugrt.load(MERGED).run(feeds)["out"]
    np.testing.assert_array_equal(ours, expected)


def test_two_nonzero_sizes_of_a_shared_dimension_still_conflict():
    feeds = {"enc": ENC, "past": np.zeros((1, 1, 4), np.float32), "use_cache": np.array(True)}
    with pytest.raises(SymbolConflictError) as info:
        plugrt.load(MERGED).run(feeds)
    assert info.value.symbol == "E" and {info.value.first[2], info.value.second[2]} == {6, 1}
