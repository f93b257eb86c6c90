"""Reading sentence-transformers' files (model-free): pooling, normalization, lengths, Matryoshka, refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxcel.embeddings.layout import (
    BATCH_TOKENS,
    MAX_INPUT_TOKENS,
    LayoutError,
    embedding_working_bytes,
    is_embedding_checkpoint,
    read_layout,
)

CONFIG = {"model_type": "bert", "hidden_size": 8, "max_position_embeddings": 512}
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def _write(directory: Path, modules: list[dict[str, Any]], pooling: dict[str, Any],
           sentence: dict[str, Any] | None = None) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if sentence is not None:
        (directory / "sentence_bert_config.json").write_text(json.dumps(sentence))
    return directory


@pytest.mark.parametrize(("pooling", "mode"), [
    ({"pooling_mode_mean_tokens": True}, "mean"), ({"pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}, "max"),
    ({"pooling_mode_lasttoken": True}, "lasttoken"), ({"pooling_mode": "cls"}, "cls"),
])
def test_the_pooling_mode_and_normalization(tmp_path: Path, pooling: dict[str, Any], mode: str) -> None:
    layout = read_layout(_write(tmp_path, [TRANSFORMER, POOLING, NORMALIZE],
                                {"word_embedding_dimension": 8, **pooling}), CONFIG)
    assert (layout.pooling, layout.normalize, layout.dimensions) == (mode, True, 8)
    assert not read_layout(_write(tmp_path, [TRANSFORMER, POOLING], pooling), CONFIG).normalize


@pytest.mark.parametrize(("modules", "pooling", "says"), [
    ([TRANSFORMER, POOLING, {"type": "sentence_transformers.models.Dense", "path": "2_Dense"}],
     {"pooling_mode_mean_tokens": True}, "Dense"),
    ([TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "one pooling mode"),
    ([TRANSFORMER, POOLING], {}, "one pooling mode"),
    ([TRANSFORMER, POOLING], {"pooling_mode_weightedmean_tokens": True}, "weightedmean"),
    ([TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True, "word_embedding_dimension": 16}, "hidden size"),
    ([TRANSFORMER], {}, "no Pooling"),
])
def test_pipelines_mlxcel_cannot_reproduce_are_refused_by_name(tmp_path: Path, modules: list[dict[str, Any]],
                                                                pooling: dict[str, Any], says: str) -> None:
    with pytest.raises(LayoutError, match=says):
        read_layout(_write(tmp_path, modules, pooling), CONFIG)


def test_the_longest_input_and_matryoshka_lengths(tmp_path: Path) -> None:
    mean = {"pooling_mode_mean_tokens": True}
    directory = _write(tmp_path, [TRANSFORMER, POOLING], mean, {"max_seq_length": 256})
    assert read_layout(directory, CONFIG).max_tokens == 256  # sentence-transformers truncates there
    (directory / "sentence_bert_config.json").unlink()
    assert read_layout(directory, CONFIG).max_tokens == 512
    roberta = {**CONFIG, "model_type": "xlm-roberta", "max_position_embeddings": 514, "pad_token_id": 1}
    assert read_layout(directory, roberta).max_tokens == 512  # positions start after the padding index
    assert read_layout(directory, {**CONFIG, "max_position_embeddings": 32768}).max_tokens == MAX_INPUT_TOKENS
    assert read_layout(directory, CONFIG).truncatable is None
    assert read_layout(directory, {**CONFIG, "is_matryoshka": True}).truncatable == ()
    assert read_layout(directory, {**CONFIG, "matryoshka_dimensions": [8, 2, 4]}).truncatable == (2, 4, 8)


def test_what_counts_as_an_embedding_checkpoint(tmp_path: Path) -> None:
    assert is_embedding_checkpoint(_write(tmp_path / "a", [TRANSFORMER, POOLING], {}))
    assert not is_embedding_checkpoint(_write(tmp_path / "b", [TRANSFORMER], {}))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "modules.json").write_text("{not json")
    assert not is_embedding_checkpoint(tmp_path / "c") and not is_embedding_checkpoint(tmp_path / "none")


def test_the_working_memory_bound() -> None:
    config = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12}
    # BERT-base at 512 tokens: activations of BATCH_TOKENS tokens, and 12 heads of BATCH_TOKENS x 512 scores.
    assert embedding_working_bytes(config, 512) == 4 * BATCH_TOKENS * (4 * 768 + 2 * 3072) + 4 * 12 * BATCH_TOKENS * 512
    # One input longer than a batch runs alone: its own length bounds both.
    assert embedding_working_bytes(config, 8192) == 4 * 8192 * (4 * 768 + 2 * 3072) + 4 * 12 * 8192 * 8192
