"""Export a benchmark set that is not ours: current architectures, exported the way users
export them, with random weights (nothing downloaded).

    python benchmarks/models.py --out build/bench_models            # every model it can make
    python benchmarks/models.py --models 'resnet|vit' --exporter dynamo
    python benchmarks/compare.py --set exports --exports build/bench_models

torchvision networks (ResNet, MobileNet v2/v3, EfficientNet, RegNet, ShuffleNet v2,
DenseNet, ConvNeXt, Swin, ViT, Inception v3) and timm models go through
``torch.onnx.export`` (the TorchScript exporter by default, ``--exporter dynamo`` for the
new one); transformers encoders and a decoder step are built from small configs and
exported the same way. Each model is built with ``torch.manual_seed(0)`` in eval mode.
Writes ``<out>/<name>.onnx`` and ``<out>/manifest.json`` (name, source, inputs, exporter,
export seconds); a model whose package is missing or whose export fails is listed with why.
Needs torch and torchvision (CPU builds do), and timm / transformers for those rows.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

#: name -> (source, constructor name, input shape)
VISION = {
    "resnet18": ("torchvision", "resnet18", (1, 3, 224, 224)),
    "resnet50": ("torchvision", "resnet50", (1, 3, 224, 224)),
    "mobilenet_v2": ("torchvision", "mobilenet_v2", (1, 3, 224, 224)),
    "mobilenet_v3_small": ("torchvision", "mobilenet_v3_small", (1, 3, 224, 224)),
    "efficientnet_b0": ("torchvision", "efficientnet_b0", (1, 3, 224, 224)),
    "regnet_y_400mf": ("torchvision", "regnet_y_400mf", (1, 3, 224, 224)),
    "shufflenet_v2_x1_0": ("torchvision", "shufflenet_v2_x1_0", (1, 3, 224, 224)),
    "densenet121": ("torchvision", "densenet121", (1, 3, 224, 224)),
    "convnext_tiny": ("torchvision", "convnext_tiny", (1, 3, 224, 224)),
    "swin_t": ("torchvision", "swin_t", (1, 3, 224, 224)),
    "vit_b_16": ("torchvision", "vit_b_16", (1, 3, 224, 224)),
    "inception_v3": ("torchvision", "inception_v3", (1, 3, 299, 299)),
    "timm_mobilevit_xs": ("timm", "mobilevit_xs", (1, 3, 256, 256)),
    "timm_efficientvit_b0": ("timm", "efficientvit_b0", (1, 3, 224, 224)),
    "timm_resnet26d": ("timm", "resnet26d", (1, 3, 224, 224)),
}
#: transformers models from small configs: name -> (model class, config class, config, sequence length)
TEXT = {
    "bert_small": ("BertModel", "BertConfig", dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                                  intermediate_size=1024, vocab_size=8000), 128),
    "distilbert_small": ("DistilBertModel", "DistilBertConfig", dict(dim=256, n_layers=4, n_heads=4, hidden_dim=1024,
                                                                    vocab_size=8000), 128),
    "gpt2_small_prefill": ("GPT2Model", "GPT2Config", dict(n_embd=256, n_layer=4, n_head=4, vocab_size=8000,
                                                          n_positions=512), 64),
}


def _no_zero_layers(model: Any) -> Any:
    """``model`` with every Linear layer initialised to zeros given small random weights
    instead: torchvision's ViT zeroes its classifier, whose output (the model's) would then
    be its bias whatever the rest computes, and the check column would compare nothing."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.detach().any():
            torch.nn.init.normal_(module.weight, std=0.02)
    return model


def _vision(source: str, constructor: str) -> Any:
    if source == "torchvision":
        import torchvision

        kwargs = {"aux_logits": False, "init_weights": False} if constructor == "inception_v3" else {}
        return _no_zero_layers(getattr(torchvision.models, constructor)(weights=None, **kwargs))
    import timm

    return timm.create_model(constructor, pretrained=False)


def _text(model_class: str, config_class: str, config: dict) -> Any:
    """The model behind a module taking (input_ids, attention_mask) by position and
    returning its last hidden state (what a feature-extraction export computes)."""
    import torch
    import transformers

    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))

    class Features(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            kwargs = {"use_cache": False} if "use_cache" in self.model.forward.__code__.co_varnames else {}
            return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state

    return Features()


def _export(model: Any, example: tuple, path: Path, names: list[str], exporter: str) -> None:
    import torch

    # nn.MultiheadAttention's fused inference path has no ONNX form (torchvision's ViT)
    torch.backends.mha.set_fastpath_enabled(False)
    if exporter == "dynamo":
        torch.onnx.export(model, example, str(path), input_names=names, dynamo=True)
    else:
        torch.onnx.export(model, example, str(path), input_names=names, opset_version=17, dynamo=False)


def export_all(out: Path, pattern: re.Pattern | None, exporter: str) -> list[dict]:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    entries = []
    jobs: list[tuple[str, str, Callable[[], tuple[Any, tuple, list[str], dict]]]] = []
    for name, (source, constructor, shape) in VISION.items():
        jobs.append((name, f"{source}.{constructor}", lambda source=source, constructor=constructor, shape=shape: (
            _vision(source, constructor), (torch.randn(*shape),), ["input"], {"input": list(shape)})))
    for name, (model_class, config_class, config, length) in TEXT.items():
        def text(model_class=model_class, config_class=config_class, config=config, length=length):
            ids = torch.randint(0, config.get("vocab_size", 1000), (1, length))
            mask = torch.ones(1, length, dtype=torch.int64)
            return (_text(model_class, config_class, config), (ids, mask), ["input_ids", "attention_mask"],
                    {"input_ids": [1, length], "attention_mask": [1, length]})
        jobs.append((name, f"transformers.{model_class}", text))
    for name, source, make in jobs:
        if pattern is not None and not pattern.search(name):
            continue
        entry: dict[str, Any] = {"name": name, "source": source, "exporter": exporter}
        try:
            torch.manual_seed(0)
            model, example, names, shapes = make()
            model.eval()
            path = out / f"{name}.onnx"
            started = time.perf_counter()
            with torch.no_grad():
                _export(model, example, path, names, exporter)
            entry.update(file=path.name, inputs=shapes, export_s=round(time.perf_counter() - started, 1))
            print(f"{name}: {entry['export_s']} s", flush=True)
        except Exception as exc:  # a missing package or an exporter failure: said, not fatal
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"{name}: not exported ({entry['error']})", flush=True)
        entries.append(entry)
    (out / "manifest.json").write_text(json.dumps({"models": entries}, indent=1))
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/bench_models"))
    parser.add_argument("--models", default="", help="regular expression (re.search) the names must match")
    parser.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript")
    args = parser.parse_args(argv)
    entries = export_all(args.out, re.compile(args.models) if args.models else None, args.exporter)
    made = sum(1 for e in entries if "file" in e)
    print(f"{made} of {len(entries)} exported to {args.out}")
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main())
