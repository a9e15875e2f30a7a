"""plugrt as an ``onnx.backend.base.Backend``, so ONNX's backend test suite can drive it."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from .session import Session

__all__ = ["PlugrtBackend", "PlugrtRep", "prepare", "run_model", "run_node", "supports_device"]

_DEVICES = {"CPU": "cpu", "CUDA": "gpu"}


class PlugrtRep(BackendRep):
    """A prepared model: ``run(inputs)`` takes a list (graph-input order) or a dict."""

    def __init__(self, session: Session, model: onnx.ModelProto):
        self.session = session
        initializers = {i.name for i in model.graph.initializer}
        self._input_names = [i.name for i in model.graph.input if i.name not in initializers]
        self._output_names = [o.name for o in model.graph.output]

    def run(self, inputs: Any, **kwargs: Any) -> tuple:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)):
                inputs = [inputs]
            feeds = dict(zip(self._input_names, inputs))
        for info in self.session.inputs:
            # onnx's runner turns a list input into one stacked array; a sequence input
            # is a list of its items again
            if info.kind == "sequence" and isinstance(feeds.get(info.name), np.ndarray):
                feeds[info.name] = list(feeds[info.name])
        outputs = self.session.run_list(None, feeds)
        return namedtupledict("Outputs", self._output_names)(*outputs)


class PlugrtBackend(Backend):
    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model: onnx.ModelProto | bytes | str, device: str = "CPU", **kwargs: Any) -> PlugrtRep:
        if isinstance(model, (bytes, str)):
            proto = onnx.load_model_from_string(model) if isinstance(model, bytes) else onnx.load(model)
        else:
            proto = model
        kind = Device(device).type
        intent = "cpu" if kind == DeviceType.CPU else "gpu"
        session = Session(proto.SerializeToString(), device=intent, options=kwargs)
        return PlugrtRep(session, proto)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(
        cls,
        node: onnx.NodeProto,
        inputs: Sequence[Any],
        device: str = "CPU",
        outputs_info: Sequence[tuple[Any, Any]] | None = None,
        **kwargs: Any,
    ) -> tuple:
        """Run one node: builds a one-node model around it with the given inputs."""
        opset = kwargs.pop("opset_version", onnx.defs.onnx_opset_version())
        graph_inputs = []
        feeds = {}
        for name, value in zip(node.input, inputs):
            if not name:
                continue
            array = np.asarray(value)
            graph_inputs.append(onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype), array.shape))
            feeds[name] = array
        graph_outputs = [onnx.helper.make_empty_tensor_value_info(name) for name in node.output if name]
        graph = onnx.helper.make_graph([node], "run_node", graph_inputs, graph_outputs)
        domains = {node.domain or ""}
        model = onnx.helper.make_model(
            graph, opset_imports=[onnx.helper.make_opsetid(d, opset if d == "" else 1) for d in domains]
        )
        rep = cls.prepare(model, device, **kwargs)
        return rep.run(feeds)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        kind = Device(device).type
        if kind == DeviceType.CPU:
            return True
        from .registry import default_registry
        from .provider import DeviceKind

        registry = default_registry()
        return any(d.kind == DeviceKind.GPU for p in registry.available() for d in registry.devices(p.name))


prepare = PlugrtBackend.prepare
run_model = PlugrtBackend.run_model
run_node = PlugrtBackend.run_node
supports_device = PlugrtBackend.supports_device
