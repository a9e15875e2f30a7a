"""Build tiny random-weight Llama-style decoders with onnxruntime-genai's model builder (fp32 and int4, CPU).

Nothing is downloaded: transformers builds the model from a config alone (seeded random
weights) and a word-level tokenizer is made on the spot, then the builder exports each
precision to ``<output>/<precision>/model.onnx`` with its ``genai_config.json``.

Needs ``torch`` (a CPU build), ``transformers`` and ``onnxruntime-genai``::

    python scripts/make_decoder_models.py --output build/decoder_models
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PRECISIONS = ("fp32", "int4")
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


def _write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over tokens "t3".."t255" plus the special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def make_hf_model(folder: Path, seed: int = 0) -> Path:
    """Save a random-weight LlamaForCausalLM and its tokenizer under ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    _write_tokenizer(folder)
    return folder


def export(hf_folder: Path, output: Path, precision: str, cache: Path) -> Path:
    """Run onnxruntime-genai's model builder for ``precision`` on the CPU execution provider."""
    target = output / precision
    command = [
        sys.executable, "-m", "onnxruntime_genai.models.builder",
        "-i", str(hf_folder), "-o", str(target), "-p", precision, "-e", "cpu", "-c", str(cache),
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    if not (target / "model.onnx").is_file():
        raise RuntimeError(f"the model builder wrote no {target / 'model.onnx'}")
    return target


def make_decoder_models(output: Path, precisions: tuple[str, ...] = PRECISIONS, seed: int = 0) -> dict[str, Path]:
    """Build the Hugging Face model once and export every precision; returns precision -> folder."""
    output.mkdir(parents=True, exist_ok=True)
    hf_folder = make_hf_model(output / "hf", seed)
    folders = {precision: export(hf_folder, output, precision, output / "cache") for precision in precisions}
    (output / "manifest.json").write_text(
        json.dumps({"config": LLAMA_CONFIG, "seed": seed, "precisions": list(folders)}, indent=2)
    )
    return folders


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("build/decoder_models"))
    parser.add_argument("--precision", choices=PRECISIONS, action="append", help="default: all")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folders = make_decoder_models(args.output, tuple(args.precision or PRECISIONS), args.seed)
    for precision, folder in folders.items():
        print(f"{precision}: {folder / 'model.onnx'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
