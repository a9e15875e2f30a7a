"""Helpers the tests share: models from ONNX text."""

from __future__ import annotations

import onnx
import onnx.parser


def model_bytes(text: str, check: bool = True) -> bytes:
    """Serialize a model written in ONNX text syntax (checked by onnx unless told not to)."""
    model = onnx.parser.parse_model(text)
    if check:
        onnx.checker.check_model(model)
    return model.SerializeToString()
