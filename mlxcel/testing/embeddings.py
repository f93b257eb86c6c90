"""Tiny embedding checkpoints in the sentence-transformers layout, built with transformers' own classes.

What a user's download of an embedding model holds: the encoder's ``config.json`` and ``model.safetensors``
(written by ``save_pretrained`` of transformers' ``BertModel`` / ``XLMRobertaModel`` / ``Qwen3Model``, random
weights from a fixed seed), its tokenizer, and sentence-transformers' ``modules.json``,
``sentence_bert_config.json`` and ``1_Pooling/config.json`` (plus ``2_Normalize`` where it normalizes). Needs torch
(the ``dev`` extra): the tests and benchmarks build these, the server never does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .base import _corpus, write_tokenizer

#: The encoder families the tests build: transformers' model class and its tiny config.
ENCODERS: dict[str, dict[str, Any]] = {
    "bert": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
             "max_position_embeddings": 128, "vocab_size": 512, "initializer_range": 0.2},
    "xlm-roberta": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                    "max_position_embeddings": 130, "vocab_size": 512, "pad_token_id": 1,
                    "initializer_range": 0.2},
    "qwen3": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 512, "vocab_size": 512,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "initializer_range": 0.2},
}
#: What sentence-transformers pools each family with, as the checkpoints users download do.
POOLING = {"bert": "mean", "xlm-roberta": "cls", "qwen3": "lasttoken"}


def build_embedding_checkpoint(directory: Path, family: str = "bert", *, pooling: str | None = None,
                               normalize: bool = True, max_seq_length: int = 64, seed: int = 0,
                               **config: Any) -> Path:
    """Write a tiny *family* (:data:`ENCODERS`) embedding checkpoint into *directory* (created); *pooling*:
    sentence-transformers' mode (default: the family's usual one); *config*: values over the tiny config."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    sizes = {**ENCODERS[family], **config}
    if family == "qwen3":
        model = transformers.Qwen3Model(transformers.Qwen3Config(**sizes))
        write_tokenizer(directory, vocab_size=sizes["vocab_size"], model_max_length=max_seq_length)
    else:
        model_class, config_class = ((transformers.BertModel, transformers.BertConfig) if family == "bert"
                                     else (transformers.XLMRobertaModel, transformers.XLMRobertaConfig))
        model = model_class(config_class(**sizes))
        _write_wordpiece(directory, sizes["vocab_size"], family, max_seq_length)
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    mode = pooling or POOLING[family]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                     "do_lower_case": False}))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    chosen = {"mean": "mean_tokens", "cls": "cls_token", "max": "max_tokens"}.get(mode, mode)
    flags = {f"pooling_mode_{name}": name == chosen for name in ("cls_token", "mean_tokens", "max_tokens",
                                                                "mean_sqrt_len_tokens", "weightedmean_tokens",
                                                                "lasttoken")}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": sizes["hidden_size"], **flags, "include_prompt": True}, indent=2))
    return directory


def _write_wordpiece(directory: Path, vocab_size: int, family: str, max_length: int) -> None:
    """A WordPiece tokenizer trained on the shared corpus, saved through transformers' fast tokenizer class."""
    import transformers
    from tokenizers import BertWordPieceTokenizer

    wordpiece = BertWordPieceTokenizer(lowercase=False)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if family == "bert" else \
        ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    wordpiece.train_from_iterator(_corpus(), vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    if family == "bert":
        fast: Any = transformers.BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, model_max_length=max_length)
    else:
        from tokenizers.processors import RobertaProcessing

        wordpiece._tokenizer.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=wordpiece._tokenizer, bos_token="<s>",
                                                    eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                                    cls_token="<s>", sep_token="</s>", mask_token="<mask>",
                                                    model_max_length=max_length)
    fast.save_pretrained(directory)
