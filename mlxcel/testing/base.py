"""What every tiny checkpoint shares: its tokenizer, chat templates and layer sizes.

No model hub is reachable, so each test model gets a real byte-level BPE tokenizer, trained with
the `tokenizers` library on a few files of the Python standard library, and a ChatML chat template,
as a user's download would hold them (``tokenizer.json``, ``tokenizer_config.json``). The generic
builder is :mod:`.checkpoints`; a family mlxcel knows more of builds its own tiny checkpoints in its
folder (``mlxcel/families/<family>/tiny.py``).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS_TURN = (
    # The tools as JSON in a system turn, in the Hermes / Qwen 2.5 manner.
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}{{ tool | tojson }}\n"
    "{%- endfor %}</tools>\nCall a function as <tool_call>{\"name\": <name>, \"arguments\": <object>}"
    "</tool_call><|im_end|>\n{% endif %}"
)
TOOL_CALLS = (
    # An assistant's calls as <tool_call>{json}</tool_call>: mlx-lm reads "<tool_call>" and "tool_call.name"
    # in a template as its json_tools format.
    "{%- for tool_call in message.tool_calls or [] %}{%- if tool_call.function %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}"
    "</tool_call>{%- endfor %}"
)
_TOOL_RESULT = "<|im_start|>user\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
TOOLS_CHATML = (
    # ChatML with tools, in the Hermes / Qwen 2.5 manner: tool results in <tool_response>.
    TOOLS_TURN +
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    + TOOL_CALLS + "<|im_end|>\n"
    "{%- elif message.role == 'tool' %}" + _TOOL_RESULT +
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{%- endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINKING_CHATML = (
    # ChatML with tools as Qwen 3.5 thinks: the generation prompt opens a <think> block unless
    # enable_thinking is false (mlx-lm passes true for a vocabulary with the markers); an assistant's
    # earlier reasoning_content is rendered back in its own block.
    TOOLS_TURN +
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}" + _TOOL_RESULT + "{% else %}<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'assistant' and message.reasoning_content %}<think>\n{{ message.reasoning_content }}"
    "\n</think>\n\n{% endif %}{{ message.content }}" + TOOL_CALLS + "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512

SIZES = {
    # A few-layer model: what every tiny config starts from (a family's own overrides some).
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "string.py", "glob.py")]


def write_tokenizer(directory: Path, chat_template: str = CHATML, added: tuple[str, ...] = (),
                    vocab_size: int = VOCAB_SIZE, model_max_length: int = 4096) -> None:
    """A byte-level BPE tokenizer of *vocab_size* tokens, then *added*: extra tokens (not special: they decode
    as their text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if added:
        tokenizer.add_tokens(list(added))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": chat_template,
        "model_max_length": model_max_length,  # the model's context window, as a real checkpoint's says
    }, indent=2))
