"""Fill-in-the-middle: a completion's ``prompt`` and ``suffix`` as the prompt a code model was trained on.

Code models learn insertion with marker tokens around the text before and after
the gap, then generate the middle. Which markers, and in which order, is the
model's: it is read from the vocabulary, the way mlx-lm reads a model's
thinking and tool-call markers. What editors' autocomplete sends (Continue,
llama.vscode, Tabby) is exactly this: ``prompt`` (before the cursor), ``suffix``
(after it), and the middle comes back as the completion's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PREFIX, SUFFIX = 0, 1
"""Where the text before the gap and the text after it go in a format's layout."""


@dataclass(frozen=True)
class FimFormat:
    """One family of markers, and the layout of the prompt: marker strings, :data:`PREFIX` and :data:`SUFFIX`."""

    layout: tuple[str | int, ...]

    @property
    def markers(self) -> tuple[str, ...]:
        """The tokens the vocabulary must hold."""
        return tuple(part for part in self.layout if isinstance(part, str))


def _deepseek(name: str) -> str:
    """DeepSeek's marker spelt with its full-width bars and its word-joining U+2581."""
    return f"<\uff5cfim\u2581{name}\uff5c>"


FORMATS = (
    # Qwen 2.5/3 Coder, CodeGemma: prefix-suffix-middle with |-delimited markers.
    FimFormat(("<|fim_prefix|>", PREFIX, "<|fim_suffix|>", SUFFIX, "<|fim_middle|>")),
    # StarCoder 1/2, SantaCoder, Granite Code.
    FimFormat(("<fim_prefix>", PREFIX, "<fim_suffix>", SUFFIX, "<fim_middle>")),
    # DeepSeek Coder: a begin, a hole and an end.
    FimFormat((_deepseek("begin"), PREFIX, _deepseek("hole"), SUFFIX, _deepseek("end"))),
    # Codestral: the suffix first.
    FimFormat(("[SUFFIX]", SUFFIX, "[PREFIX]", PREFIX)),
)


def fim_format(tokenizer: Any) -> FimFormat | None:
    """The model's fill-in-the-middle format, or None when its vocabulary has none of the known markers.

    Looked up marker by marker (``get_vocab`` would build a dict of the whole vocabulary per request).
    """
    unknown = {None, getattr(tokenizer, "unk_token_id", None)}
    for form in FORMATS:
        try:
            ids = tokenizer.convert_tokens_to_ids(list(form.markers))
        except Exception:  # a tokenizer that cannot look tokens up
            return None
        if all(i not in unknown for i in ids):
            return form
    return None


def fim_prompt(form: FimFormat, prefix: str, suffix: str) -> str:
    """The prompt that asks for the text between *prefix* and *suffix*."""
    texts = {PREFIX: prefix, SUFFIX: suffix}
    return "".join(part if isinstance(part, str) else texts[part] for part in form.layout)
