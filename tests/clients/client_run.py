"""Run one client task (optimum or sentence-transformers) on one runtime and save its outputs.

``python client_run.py RUNTIME TASK WORKDIR OUT.npz``: RUNTIME is ``onnxruntime`` or
``plugrt`` (standing in through plugrt.install_as_onnxruntime()). A client library imports
onnxruntime once per process, so each runtime runs in a process of its own; the tiny models
(random weights, built from transformers configs) are made and exported into WORKDIR on the
first call and reused afterwards.
"""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = [f"w{i}" for i in range(90)]


def _tokenizer(path: str):
    """A word-level tokenizer over WORDS, saved to ``path`` (nothing from a hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                  sep_token="[SEP]", mask_token="[MASK]", model_max_length=64)
    tok.save_pretrained(path)
    return tok


def _once(path: str, make) -> str:
    if not os.path.exists(path):
        make(path)
    return path


def _bert(path: str) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=64, num_labels=3)
    BertForSequenceClassification(config).save_pretrained(path)
    _tokenizer(path)


def _export(task_class, src: str, path: str, **kw) -> str:
    def make(out: str) -> None:
        task_class.from_pretrained(src, export=True, **kw).save_pretrained(out)
        if os.path.exists(os.path.join(src, "tokenizer.json")):
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return _once(path, make)


def run(task: str, work: str) -> dict:
    import numpy as np
    import torch

    torch.manual_seed(0)
    out: dict = {}
    texts = ["w1 w2 w3 w4", "w5 w6 w7"]
    if task in ("classification", "features", "pipelines"):
        from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTModelForSequenceClassification
        from transformers import AutoTokenizer, pipeline

        src = _once(os.path.join(work, "bert-src"), _bert)
        tok = AutoTokenizer.from_pretrained(src)
        batch = tok(texts, padding=True, return_tensors="pt")
        if task == "classification":
            model = ORTModelForSequenceClassification.from_pretrained(_export(ORTModelForSequenceClassification, src, os.path.join(work, "bert-cls")))
            out["logits"] = model(**batch).logits.detach().numpy()
        elif task == "features":
            model = ORTModelForFeatureExtraction.from_pretrained(_export(ORTModelForFeatureExtraction, src, os.path.join(work, "bert-feat")))
            out["last_hidden_state"] = model(**batch).last_hidden_state.detach().numpy()
        else:
            cls = ORTModelForSequenceClassification.from_pretrained(os.path.join(work, "bert-cls"))
            scores = pipeline("text-classification", model=cls, tokenizer=tok, top_k=None)(texts)
            out["text_classification"] = np.array([[s["score"] for s in sorted(r, key=lambda s: s["label"])] for r in scores])
            feat = ORTModelForFeatureExtraction.from_pretrained(os.path.join(work, "bert-feat"))
            out["feature_extraction"] = np.array(pipeline("feature-extraction", model=feat, tokenizer=tok)(texts[0]))
    elif task in ("gpt2", "llama"):
        from optimum.onnxruntime import ORTModelForCausalLM

        def make(path: str) -> None:
            if task == "gpt2":
                from transformers import GPT2Config, GPT2LMHeadModel

                GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)).save_pretrained(path)
            else:
                from transformers import LlamaConfig, LlamaForCausalLM

                config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64)
                LlamaForCausalLM(config).save_pretrained(path)
        src = _once(os.path.join(work, f"{task}-src"), make)
        onnx_dir = _export(ORTModelForCausalLM, src, os.path.join(work, f"{task}-onnx"), use_cache=True)
        ids = torch.tensor([[5, 7, 9, 11], [3, 4, 6, 8]])
        mask = torch.ones_like(ids)
        for io in (False, True):
            model = ORTModelForCausalLM.from_pretrained(onnx_dir, use_cache=True, use_io_binding=io)
            out[f"logits_io{int(io)}"] = model(input_ids=ids, attention_mask=mask).logits.detach().numpy()
            out[f"tokens_io{int(io)}"] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0).numpy()
    elif task == "t5":
        from optimum.onnxruntime import ORTModelForSeq2SeqLM
        from transformers import T5Config, T5ForConditionalGeneration

        def make(path: str) -> None:
            config = T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
            T5ForConditionalGeneration(config).save_pretrained(path)
        src = _once(os.path.join(work, "t5-src"), make)
        # the merged decoder (one graph with an If on use_cache_branch), whose first step feeds empty past tensors
        model = ORTModelForSeq2SeqLM.from_pretrained(_export(ORTModelForSeq2SeqLM, src, os.path.join(work, "t5-onnx"), use_merged=True))
        assert model.decoder.is_merged
        ids = torch.tensor([[5, 7, 9, 11, 13, 1]])
        out["tokens"] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False).numpy()
        decoder = torch.tensor([[0, 5, 7]])
        out["logits"] = model(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=decoder).logits.detach().numpy()
    elif task == "whisper":
        from optimum.onnxruntime import ORTModelForSpeechSeq2Seq
        from transformers import WhisperConfig, WhisperForConditionalGeneration

        def make(path: str) -> None:
            config = WhisperConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                   decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                                   max_source_positions=1500, max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                                   eos_token_id=2, bos_token_id=1, suppress_tokens=[], begin_suppress_tokens=[])
            WhisperForConditionalGeneration(config).save_pretrained(path)
        src = _once(os.path.join(work, "whisper-src"), make)
        model = ORTModelForSpeechSeq2Seq.from_pretrained(_export(ORTModelForSpeechSeq2Seq, src, os.path.join(work, "whisper-onnx"), use_merged=True))
        assert model.decoder.is_merged
        features = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 8, 3000)).astype(np.float32))
        out["tokens"] = model.generate(input_features=features, max_new_tokens=6, do_sample=False).numpy()
        out["logits"] = model(input_features=features, decoder_input_ids=torch.tensor([[1, 5, 7]])).logits.detach().numpy()
    elif task == "image":
        from optimum.onnxruntime import ORTModelForImageClassification
        from transformers import ViTConfig, ViTForImageClassification

        def make(path: str) -> None:
            config = ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, num_labels=4)
            ViTForImageClassification(config).save_pretrained(path)
        src = _once(os.path.join(work, "vit-src"), make)
        model = ORTModelForImageClassification.from_pretrained(_export(ORTModelForImageClassification, src, os.path.join(work, "vit-onnx")))
        pixels = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32))
        out["logits"] = model(pixel_values=pixels).logits.detach().numpy()
    elif task == "sentence":
        from sentence_transformers import SentenceTransformer, models

        def make(path: str) -> None:
            bert = _once(os.path.join(work, "bert-src"), _bert)
            word = models.Transformer(bert, max_seq_length=32)
            SentenceTransformer(modules=[word, models.Pooling(word.get_word_embedding_dimension())]).save(path)
        src = _once(os.path.join(work, "st-src"), make)
        model = SentenceTransformer(src, backend="onnx", device="cpu")
        out["embeddings"] = model.encode(texts, convert_to_numpy=True)
    else:
        raise SystemExit(f"unknown task {task!r}")
    return out


def main() -> None:
    runtime, task, work, target = sys.argv[1:5]
    if runtime == "plugrt":
        import plugrt

        plugrt.install_as_onnxruntime()
    import numpy as np

    outputs = run(task, work)
    import onnxruntime

    outputs["runtime_module"] = np.array(onnxruntime.__name__)
    np.savez(target, **outputs)


if __name__ == "__main__":
    main()
