"""Build tiny random-weight transformer test models: Llama decoders by onnxruntime-genai's builder, and more.

Nothing is downloaded: transformers builds each model from a config alone (seeded random
weights) and a word-level tokenizer is made on the spot, then the builder exports each
precision to ``<output>/<precision>/model.onnx`` with its ``genai_config.json``. With
``--fused``, a BERT encoder and a GPT-2 decoder are also exported the torch way
(``torch.onnx.export``) and fused by onnxruntime's transformer optimizer into
``<output>/fused/{bert,gpt2}.onnx`` (EmbedLayerNormalization, Attention,
SkipLayerNormalization, BiasGelu, FastGelu).

Needs ``torch`` (a CPU build), ``transformers`` and ``onnxruntime-genai``::

    python scripts/make_decoder_models.py --output build/decoder_models
    python scripts/make_decoder_models.py --shape smollm2-135m --precision int4 --output build/smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

PRECISIONS = ("fp32", "int4")
#: every precision the builder is asked for: int4 is its default MatMulNBits (4 bits, block
#: 32, accuracy_level 4: int8 activations); int4-acc1 multiplies in float32 (accuracy_level 1)
ALL_PRECISIONS = ("fp32", "int4", "int4-acc1")
VOCAB_SIZE = 256
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")

# 2 layers, hidden 64, grouped heads (4 query heads over 2 key/value heads).
LLAMA_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    # wider than the default 0.02 so the logits of different tokens stand well apart and
    # greedy decoding does not hinge on rounding
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


#: the shapes people run on a CPU, from their published configs (random weights, nothing
#: downloaded): (transformers architecture, config fields over LLAMA_CONFIG's)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("llama", {}),
    "smollm2-135m": ("llama", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0, tie_word_embeddings=True,
        initializer_range=0.02,
    )),
    "qwen2.5-0.5b": ("qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, initializer_range=0.02,
    )),
}


def _write_tokenizer(folder: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """A word-level tokenizer over tokens "t3".."t<vocab_size - 1>" plus the special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def shape_config(shape: str = "tiny") -> tuple[str, dict[str, Any]]:
    """(architecture, config fields) of a named shape."""
    try:
        architecture, changes = SHAPES[shape]
    except KeyError:
        raise ValueError(f"unknown shape {shape!r}; shapes: {', '.join(SHAPES)}") from None
    return architecture, {**LLAMA_CONFIG, **changes}


def make_hf_model(folder: Path, seed: int = 0, shape: str = "tiny") -> Path:
    """Save a random-weight causal LM of ``shape`` and its tokenizer under ``folder``."""
    import torch
    import transformers

    architecture, fields = shape_config(shape)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[architecture]
    torch.manual_seed(seed)
    model = model_class(config_class(**fields)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    _write_tokenizer(folder, fields["vocab_size"])
    return folder


def export(hf_folder: Path, output: Path, precision: str, cache: Path) -> Path:
    """Run onnxruntime-genai's model builder for ``precision`` on the CPU execution provider."""
    target = output / precision
    base, _, level = precision.partition("-acc")
    command = [
        sys.executable, "-m", "onnxruntime_genai.models.builder",
        "-i", str(hf_folder), "-o", str(target), "-p", base, "-e", "cpu", "-c", str(cache),
    ]
    if level:
        command += ["--extra_options", f"accuracy_level={level}"]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the model builder failed for {precision}:\n{done.stderr[-3000:]}")
    if not (target / "model.onnx").is_file():
        raise RuntimeError(f"the model builder wrote no {target / 'model.onnx'}")
    return target


def make_decoder_models(
    output: Path, precisions: tuple[str, ...] = PRECISIONS, seed: int = 0, shape: str = "tiny"
) -> dict[str, Path]:
    """Build the Hugging Face model once and export every precision; returns precision -> folder."""
    output.mkdir(parents=True, exist_ok=True)
    hf_folder = make_hf_model(output / "hf", seed, shape)
    folders = {precision: export(hf_folder, output, precision, output / "cache") for precision in precisions}
    architecture, fields = shape_config(shape)
    (output / "manifest.json").write_text(json.dumps(
        {"shape": shape, "architecture": architecture, "config": fields, "seed": seed, "precisions": list(folders)},
        indent=2,
    ))
    return folders


def _keyword_module(model: Any, names: tuple[str, ...], outputs: tuple[str, ...]) -> Any:
    """``model`` as a module torch.onnx.export can trace: positional inputs passed on by
    name, the named fields of its output returned as a tuple."""
    import torch

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: Any) -> Any:
            result = self.model(**dict(zip(names, args)))
            return tuple(getattr(result, name) for name in outputs)

    return Wrapped().eval()


def export_fused(output: Path, seed: int = 0) -> dict[str, Path]:
    """BERT and GPT-2 exported by torch.onnx.export, then fused by onnxruntime's optimizer."""
    import torch
    from onnxruntime.transformers.optimizer import optimize_model
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    folder = output / "fused"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    bert_config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, type_vocab_size=2,
    )
    gpt2_config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, n_inner=64)
    specs = {
        "bert": (BertModel, bert_config, ("input_ids", "attention_mask", "token_type_ids"),
                 ("last_hidden_state", "pooler_output")),
        "gpt2": (GPT2Model, gpt2_config, ("input_ids", "attention_mask"), ("last_hidden_state",)),
    }
    paths = {}
    for name, (model_class, config, inputs, outputs) in specs.items():
        config._attn_implementation = "eager"  # the attention pattern the optimizer fuses
        model = _keyword_module(model_class(config).eval(), inputs, outputs)
        samples = {
            "input_ids": torch.randint(0, 64, (2, 7)),
            "attention_mask": torch.ones(2, 7, dtype=torch.int64),
            "token_type_ids": torch.randint(0, 2, (2, 7)),
        }
        example = tuple(samples[n] for n in inputs)
        raw = folder / f"{name}_unfused.onnx"
        axes = {n: {0: "batch", 1: "sequence"} for n in inputs}
        torch.onnx.export(
            model, example, str(raw), input_names=list(inputs), output_names=list(outputs),
            dynamic_axes=axes, opset_version=17, dynamo=False,
        )
        fused = optimize_model(str(raw), model_type=name, num_heads=4, hidden_size=32)
        paths[name] = folder / f"{name}.onnx"
        fused.save_model_to_file(str(paths[name]))
        raw.unlink()
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("build/decoder_models"))
    parser.add_argument("--precision", choices=ALL_PRECISIONS, action="append", help="default: fp32 and int4")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                        help="tiny (the tests' 2-layer Llama) or a shape people run: smollm2-135m, qwen2.5-0.5b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fused", action="store_true", help="also export the fused BERT and GPT-2 models")
    parser.add_argument("--fused-only", action="store_true", help="export only the fused BERT and GPT-2 models")
    args = parser.parse_args(argv)
    if not args.fused_only:
        folders = make_decoder_models(args.output, tuple(args.precision or PRECISIONS), args.seed, args.shape)
        for precision, folder in folders.items():
            print(f"{precision}: {folder / 'model.onnx'}")
    if args.fused or args.fused_only:
        for name, path in export_fused(args.output, args.seed).items():
            print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
