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


NEG_ADD = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[3] x) => (float[3] y) {
        n = Neg(x)
        y = Add(n, x)
    }
    """
)


#: y = local.Double(x), a model-local function whose body is Add(a, a).
LOCAL_DOUBLE = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17, "local" : 1]>
    g (float[2] x) => (float[2] y) {
        y = local.Double(x)
    }
    <domain: "local", opset_import: ["" : 17]>
    Double (a) => (b) {
        b = Add(a, a)
    }
    """
)


def fake_entry_points(monkeypatch, *extra: tuple[str, str]) -> None:
    """Make importlib.metadata report the real plugrt entry points plus ``extra``
    (name, "module:attr") pairs, as if more distributions were installed."""
    import importlib_metadata

    from plugrt import registry as registry_module

    real = importlib_metadata.entry_points

    def entry_points(**params):
        found = list(real(**params))
        if params.get("group") == "plugrt.providers":
            found += [importlib_metadata.EntryPoint(n, v, "plugrt.providers") for n, v in extra]
        return found

    monkeypatch.setattr(registry_module.importlib_metadata, "entry_points", entry_points)
