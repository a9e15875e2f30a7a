"""Write the example model bundled with plugrt (core/plugrt/examples/tiny_cnn.onnx).

A small image classifier, 1x3x32x32 in and 10 class probabilities out: Conv, Relu,
MaxPool, Conv, Relu, GlobalAveragePool, Flatten, Gemm, Softmax. Weights are random
but deterministic (seed 0), so the file is reproducible byte for byte.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = os.path.join(os.path.dirname(__file__), "..", "core", "plugrt", "examples", "tiny_cnn.onnx")


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        data = (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        return numpy_helper.from_array(data, name)

    inits = [
        weight("conv1.w", 16, 3, 3, 3), numpy_helper.from_array(np.zeros(16, np.float32), "conv1.b"),
        weight("conv2.w", 32, 16, 3, 3), numpy_helper.from_array(np.zeros(32, np.float32), "conv2.b"),
        weight("fc.w", 10, 32), numpy_helper.from_array(np.zeros(10, np.float32), "fc.b"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "conv1.w", "conv1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2.w", "conv2.b"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["probabilities"], name="softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="plugrt-examples")
    model.ir_version = 8
    model.doc_string = "A small convolutional classifier with deterministic random weights (plugrt's bundled example)."
    onnx.checker.check_model(model)
    return model


if __name__ == "__main__":
    onnx.save(build(), OUT)
    print(f"wrote {os.path.normpath(OUT)}")
