"""The provider conformance suite: ONNX node cases and protocol checks."""
