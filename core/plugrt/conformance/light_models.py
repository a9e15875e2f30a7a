"""The light models shipped with onnx (onnx/backend/test/data/light) and their expected outputs."""

from __future__ import annotations

import dataclasses
import glob
import os

import numpy as np
import onnx

__all__ = ["LightModel", "light_models", "light_model_dir"]


@dataclasses.dataclass
class LightModel:
    name: str  # e.g. "resnet50"
    path: str
    inputs: dict[str, np.ndarray]
    expected: list[np.ndarray]


def light_model_dir() -> str:
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def _dummy_input(value_info: onnx.ValueInfoProto) -> np.ndarray:
    # The same deterministic input onnx's backend test runner makes for these models.
    shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in value_info.type.tensor_type.shape.dim)
    count = int(np.prod(shape))
    return (np.arange(count).reshape(shape) / count).astype(np.float32)


def light_models() -> list[LightModel]:
    models = []
    for path in sorted(glob.glob(os.path.join(light_model_dir(), "light_*.onnx"))):
        name = os.path.basename(path)[len("light_") : -len(".onnx")]
        proto = onnx.load(path, load_external_data=False)
        initializers = {i.name for i in proto.graph.initializer}
        inputs = {i.name: _dummy_input(i) for i in proto.graph.input if i.name not in initializers}
        expected = []
        for index in range(len(proto.graph.output)):
            with open(f"{path[:-5]}_output_{index}.pb", "rb") as f:
                tensor = onnx.TensorProto()
                tensor.ParseFromString(f.read())
            expected.append(onnx.numpy_helper.to_array(tensor))
        models.append(LightModel(name, path, inputs, expected))
    return models
