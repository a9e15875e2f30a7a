"""``onnxruntime.transformers`` as the stand-in serves it: the helpers clients import."""
