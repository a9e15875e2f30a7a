"""The light models shipped with onnx (onnx/backend/test/data/light) and their expected outputs."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os

import numpy as np
import onnx

__all__ = ["LightModel", "light_models", "light_model_dir", "with_logits", "with_random_weights", "arrays_digest"]


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


def with_logits(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` that also outputs the input of each Softmax producing a graph
    output (the logits), and those names. Outputs of models whose weights are constants
    saturate (one ulp flips a one-hot), so results are compared on the logits too."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    outputs = {o.name for o in copy.graph.output}
    logits = [n.input[0] for n in copy.graph.node if n.op_type == "Softmax" and n.output[0] in outputs]
    for name in logits:
        copy.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return copy, logits


def with_random_weights(model: onnx.ModelProto, seed: int = 0) -> tuple[onnx.ModelProto, str]:
    """A copy of ``model`` whose ConstantOfShape weights (every light model's weights are
    one value) are random initializers, and the SHA-256 of those weights' bytes.

    The values come from ``numpy.random.RandomState(seed)``, whose stream numpy keeps the
    same across versions, so another machine makes the same model and can check the digest.
    Tensors of two or more dimensions are uniform with variance 1/fan-in; vectors (biases,
    batch-norm statistics) are uniform in [0.5, 1.5], so variances stay positive."""
    rng = np.random.RandomState(seed)
    digest = hashlib.sha256()
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    shapes = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    kept = []
    for node in graph.node:
        if node.op_type != "ConstantOfShape" or node.input[0] not in shapes:
            kept.append(node)
            continue
        shape = tuple(int(d) for d in shapes[node.input[0]].reshape(-1))
        if len(shape) >= 2:
            bound = float(np.sqrt(3.0 / max(1, int(np.prod(shape[1:])))))
            values = rng.uniform(-bound, bound, shape).astype(np.float32)
        else:
            values = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        digest.update(values.tobytes())
        graph.initializer.append(onnx.numpy_helper.from_array(values, node.output[0]))
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in graph.node for name in node.input}
    unused = [i for i in graph.initializer if i.name not in used and i.name in shapes]
    for initializer in unused:
        graph.initializer.remove(initializer)
    dropped = {i.name for i in unused}
    for value in [v for v in graph.input if v.name in dropped]:  # IR 3 lists initializers as inputs
        graph.input.remove(value)
    return copy, digest.hexdigest()


def arrays_digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over named arrays (names sorted, then each one's bytes): whether two machines
    made the same inputs."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest()
