"""Train the bundled default pairing: a small Qwen 3.5-layout model with an in-checkpoint MTP head.

    python -m mlxcel.families.qwen3_5.train_default [--steps 800] [--seed 0] [--out DIR]

Corpus: the Python standard library's own ``.py`` sources, from the interpreter
running this script (Python Software Foundation License; nothing is
downloaded). Files are taken in sorted order; every 20th (by a hash of its
path) is held out for evaluation prompts. The tokenizer is a 1,024-token
byte-level BPE trained on the training files with the `tokenizers` library.

Model: the ``qwen3_5`` hybrid layout (gated-delta linear attention and full
attention layers alternating, ``full_attention_interval: 2``), 8 layers,
hidden 192, tied embeddings, in fp32 (the fast path of the CPU backend with
OpenBLAS), plus a one-layer ``qwen3_5_mtp`` head. Target and head train jointly: next-token loss plus half
the head's loss on the token after next, the head reading the target's final
hidden state and the embedding of the next token, exactly as it drafts at
serving time.

Deterministic given the seed (on the same machine and BLAS): the corpus order,
the batches and the initialisation all derive from it. About 25 minutes on a
2-core CPU with OpenBLAS (450 steps of 16 x 256 tokens).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", str(os.cpu_count() or 1))  # training: use every core

from mlxcel.blas import load_fast_blas

BLAS = load_fast_blas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

NAME = "qwen35-stdlib-4m"
DEFAULT_OUT = Path(__file__).parent / "bundled" / NAME  # BUNDLED_MODEL
VOCAB = 1024
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIG = {
    "model_type": "qwen3_5",
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "tie_word_embeddings": True,
    "mtp_num_hidden_layers": 1,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 192,
        "num_hidden_layers": 8,
        "intermediate_size": 512,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 48,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [4, 4, 0]},
        "torch_dtype": "float32",
    },
}


def _flat(tree: object) -> list[tuple[str, Any]]:
    flat: list[tuple[str, Any]] = tree_flatten(tree)  # type: ignore[assignment]
    return flat


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library's own sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "turtledemo", "__pycache__"}
    files = [f for f in sorted(root.rglob("*.py"))
             if not any(p in skip or p.startswith("lib2to3") for p in f.relative_to(root).parts)]
    held = [f for f in files if int(hashlib.sha256(str(f.relative_to(root)).encode()).hexdigest(), 16) % 20 == 0]
    return [f for f in files if f not in held], held


def train_tokenizer(files: list[Path], out: Path) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((f.read_text(encoding="utf-8", errors="replace") for f in files),
                                  trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML, "model_max_length": 2048,
    }, indent=2) + "\n")
    return tokenizer


def encode(tokenizer: object, files: list[Path]) -> np.ndarray:
    eos = tokenizer.token_to_id("<|endoftext|>")  # type: ignore[attr-defined]
    ids: list[int] = []
    for f in files:
        ids.extend(tokenizer.encode(f.read_text(encoding="utf-8", errors="replace")).ids)  # type: ignore[attr-defined]
        ids.append(eos)
    return np.array(ids, dtype=np.int32)


class Pairing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from mlx_lm.utils import _get_classes

        from mlxcel.families.qwen3_5.mtp import Qwen35MTP, text_args

        model_class, args_class = _get_classes(CONFIG)
        self.model = model_class(args_class.from_dict(CONFIG))
        self.mtp = Qwen35MTP(text_args(CONFIG), num_layers=1)


def losses(pairing: Pairing, batch: mx.array) -> tuple[mx.array, mx.array]:
    """(next-token loss, the head's token-after-next loss)."""
    body = pairing.model.language_model.model
    hidden = body(batch[:, :-1])
    target = nn.losses.cross_entropy(body.embed_tokens.as_linear(hidden), batch[:, 1:]).mean()
    drafted = pairing.mtp(body.embed_tokens(batch[:, 1:-1]), hidden[:, :-1], [None])
    head = nn.losses.cross_entropy(body.embed_tokens.as_linear(drafted), batch[:, 2:]).mean()
    return target, head


def save(pairing: Pairing, out: Path) -> None:
    """The raw Hugging Face layout: HF tensor names, conv1d as (C, 1, K), zero-centred RMSNorm weights."""
    norms = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
             ".q_norm.weight", ".k_norm.weight")
    weights = {}
    for name, value in _flat(pairing.model.parameters()):
        if "conv1d.weight" in name:
            value = value.moveaxis(2, 1)
        elif value.ndim == 1 and name.endswith(norms):
            value = value - 1.0
        weights[name.replace("language_model.model.", "model.language_model.")] = value
    for name, value in _flat(pairing.mtp.parameters()):
        weights[f"mtp.{name}"] = value - 1.0 if value.ndim == 1 and "norm" in name else value
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=CONFIG["text_config"]["num_hidden_layers"])  # type: ignore[index]
    parser.add_argument("--hidden", type=int, default=CONFIG["text_config"]["hidden_size"])  # type: ignore[index]
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--files", type=int, default=None, metavar="N",
                        help="train on the first N corpus files only (a quick run; default: all)")
    args = parser.parse_args()
    text = CONFIG["text_config"]
    assert isinstance(text, dict)
    # The MLP keeps the default's 8/3 ratio, rounded down to a multiple of 64.
    text.update(num_hidden_layers=args.layers, hidden_size=args.hidden,
                intermediate_size=args.hidden * 8 // 3 // 64 * 64)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"BLAS: {BLAS}")
    train_files, held = corpus_files()
    train_files = train_files[:args.files]
    tokenizer = train_tokenizer(train_files, args.out)
    data, held_data = encode(tokenizer, train_files), encode(tokenizer, held)
    print(f"corpus: {len(train_files)} files, {data.size:,} tokens; held out: {len(held)} files, "
          f"{held_data.size:,} tokens")
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    pairing = Pairing()
    params = sum(v.size for _, v in _flat(pairing.parameters()))
    print(f"parameters: {params:,} ({params * 4 / 1e6:.1f} MB in fp32)")

    warmup = max(1, min(50, args.steps // 10))
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-5, args.lr, warmup),
         optim.cosine_decay(args.lr, max(1, args.steps - warmup), args.lr * 0.1)], [warmup])
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    def objective(model: Pairing, batch: mx.array) -> mx.array:
        target, head = losses(model, batch)
        return target + 0.5 * head

    step = nn.value_and_grad(pairing, objective)

    def batch_from(tokens: np.ndarray, count: int) -> mx.array:
        starts = rng.integers(0, tokens.size - args.length - 2, size=count)
        return mx.array(np.stack([tokens[s:s + args.length + 1] for s in starts]))

    held_batch = batch_from(held_data, 16)
    started = time.perf_counter()
    for i in range(1, args.steps + 1):
        loss, grads = step(pairing, batch_from(data, args.batch))
        optimizer.update(pairing, grads)
        mx.eval(pairing.parameters(), optimizer.state, loss)
        if i % 50 == 0 or i == args.steps:
            target, head = (float(x.item()) for x in losses(pairing, held_batch))  # type: ignore[arg-type]
            elapsed = time.perf_counter() - started
            print(f"step {i}/{args.steps}: train {loss.item():.3f}, held-out next {target:.3f} "
                  f"(ppl {math.exp(target):.1f}), after-next {head:.3f}; "
                  f"{elapsed / 60:.1f} min", flush=True)
    save(pairing, args.out)
    print(f"wrote {args.out} ({(args.out / 'model.safetensors').stat().st_size / 1e6:.1f} MB)")



def held_out_prompts(count: int = 8, seed: int = 0) -> list[str]:
    """Prompts from the held-out files: a function's signature and docstring opening, never trained on."""
    _, held = corpus_files()
    rng = np.random.default_rng(seed)
    prompts = []
    for file in held:
        lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
        if starts:
            start = starts[int(rng.integers(0, len(starts)))]
            prompts.append("\n".join(lines[start:start + 2]) + "\n")
    return prompts[:count]


if __name__ == "__main__":
    main()
