"""The CPU kernels, one module per op family; importing this package registers them all."""

from . import (
    elementwise,
    tensor,
    generator,
    conv,
    pooling,
    softmax,
    dropout,
    lrn,
    normalization,
    reduction,
    linalg,
    quantization,
    controlflow,
    sequence,
    rnn,
    attention,
    signal,
    image,
    text,
    loss,
    training,
    ml,
    contrib_attention,
    contrib_quantization,
    contrib_normalization,
)

__all__ = ["elementwise", "tensor", "generator", "conv", "pooling", "softmax", "dropout", "lrn", "normalization", "reduction", "linalg", "quantization", "controlflow", "sequence", "rnn", "attention", "signal", "image", "text", "loss", "training", "ml", "contrib_attention", "contrib_quantization", "contrib_normalization", ]
