"""GLM-4.7-Flash (``glm4_moe_lite``): the burst on vs off, and `mlxcel split-mtp`'s time and peak memory.

    python -m benchmarks.glm_mtp speedup [--k 2 3] [--tokens 128]
    python -m benchmarks.glm_mtp split [--experts 64 --vocab 32768]

``speedup``: a synthetic agreeing pairing (the target's next token depends
only on the current one, the next-token layer predicts it: mlxcel/families/glm4_moe_lite/tiny.py,
context 0) and a random next-token layer, each split by `mlxcel split-mtp` and
served pinned on and pinned off side by side; acceptance, tokens per round,
both decode rates (median over the prompts) and the ratio.

``split``: a raw checkpoint whose next-token layer has GLM-4.7-Flash's own
attention and hidden sizes (2048; 64 experts of a narrower MLP and a smaller
vocabulary, so it is a few hundred MB, in bf16 as the real one is), split as
is and with ``--q-bits 4``, each in a subprocess whose peak RSS is read; beside
it the same layer loaded whole and saved (what a split that does not stream does).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks._common import BENCH_DIR, complete, decode_rate, median, server

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "for line in lines:",
           "def dedent(text):", "if __name__ == '__main__':"]
BENCH_TEXT = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 64,
              "q_lora_rank": 96, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
              "num_hidden_layers": 8, "initializer_range": 0.1}


def _pairing(drafter: str) -> tuple[Path, Path]:
    from mlxcel.families.glm4_moe_lite.tiny import build_glm_checkpoint

    raw = BENCH_DIR / f"glm-{drafter}-l8-h256"
    head = BENCH_DIR / f"glm-{drafter}-l8-h256-MTP"
    if not (raw / "config.json").exists():
        build_glm_checkpoint(raw, drafter=drafter, context_scale=0.0 if drafter == "aligned" else 1.0,
                             text=BENCH_TEXT)
    if not (head / "config.json").exists():
        subprocess.run([sys.executable, "-m", "mlxcel", "split-mtp", "-m", str(raw), "-o", str(head)], check=True,
                       capture_output=True)
    return raw, head


def speedup(ks: list[int], tokens: int) -> None:
    print(f"{'drafter':>8} {'K':>2} {'accept':>7} {'tok/round':>9} {'off tok/s':>9} {'on tok/s':>9} {'ratio':>6}")
    for drafter in ("aligned", "random"):
        raw, head = _pairing(drafter)
        for k in ks:
            env = {"MLXCEL_DRAFT_BLOCK_SIZE": str(k)}
            with server(raw, "--draft-model", str(head), env={**env, "MLXCEL_ENABLE_MTP_B1": "0"}) as off, \
                    server(raw, "--draft-model", str(head), env={**env, "MLXCEL_ENABLE_MTP_B1": "1"}) as on, \
                    httpx.Client(timeout=600) as client:
                complete(client, off, "warm up", 8)
                complete(client, on, "warm up", 8)
                off_rates, on_rates, proposed, accepted, rounds = [], [], 0, 0, 0
                for prompt in PROMPTS:
                    off_rates.append(decode_rate(complete(client, off, prompt, tokens)))
                    body = complete(client, on, prompt, tokens)
                    on_rates.append(decode_rate(body))
                    t = body["timings"]
                    proposed, accepted, rounds = (proposed + t["draft_n"], accepted + t["draft_n_accepted"],
                                                  rounds + t["draft_rounds"])
            rate = accepted / proposed if proposed else 0.0
            per_round = 1 + (accepted / rounds if rounds else 0.0)
            print(f"{drafter:>8} {k:>2} {rate:>7.2f} {per_round:>9.2f} {median(off_rates):>9.1f} "
                  f"{median(on_rates):>9.1f} {median(on_rates) / median(off_rates):>6.2f}", flush=True)


def _big_raw(experts: int, vocab: int) -> tuple[Path, int]:
    """A raw checkpoint, one small target layer and a next-token layer of GLM-4.7-Flash's widths; its layer's bytes."""
    import mlx.core as mx

    directory = BENCH_DIR / f"glm-split-e{experts}-v{vocab}"
    text = {"model_type": "glm4_moe_lite", "architectures": ["Glm4MoeLiteForCausalLM"], "vocab_size": vocab,
            "hidden_size": 2048, "intermediate_size": 1024, "moe_intermediate_size": 512, "num_hidden_layers": 1,
            "num_attention_heads": 20, "num_key_value_heads": 20, "n_shared_experts": 1, "n_routed_experts": experts,
            "num_experts_per_tok": 4, "kv_lora_rank": 512, "q_lora_rank": 768, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 192, "v_head_dim": 256, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
            "rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "n_group": 1, "topk_group": 1}
    h, inter, heads = 2048, 512, 20
    layer = "model.layers.1."
    shards: list[dict[str, tuple[int, ...]]] = [
        {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)},
        {f"{layer}embed_tokens.weight": (vocab, h), f"{layer}shared_head.head.weight": (vocab, h),
         f"{layer}enorm.weight": (h,), f"{layer}hnorm.weight": (h,), f"{layer}eh_proj.weight": (h, 2 * h),
         f"{layer}shared_head.norm.weight": (h,), f"{layer}input_layernorm.weight": (h,),
         f"{layer}post_attention_layernorm.weight": (h,), f"{layer}self_attn.q_a_proj.weight": (768, h),
         f"{layer}self_attn.q_a_layernorm.weight": (768,), f"{layer}self_attn.q_b_proj.weight": (heads * 256, 768),
         f"{layer}self_attn.kv_a_proj_with_mqa.weight": (576, h), f"{layer}self_attn.kv_a_layernorm.weight": (512,),
         f"{layer}self_attn.kv_b_proj.weight": (heads * 448, 512), f"{layer}self_attn.o_proj.weight": (h, heads * 256),
         f"{layer}mlp.gate.weight": (experts, h), f"{layer}mlp.gate.e_score_correction_bias": (experts,),
         **{f"{layer}mlp.shared_experts.{p}.weight": s for p, s in
            (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter)))}},
        {f"{layer}mlp.experts.{e}.{p}.weight": s for e in range(experts) for p, s in
         (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter)))},
    ]
    layer_bytes = sum(2 * _count(s) for shard in shards[1:] for s in shard.values())
    if (directory / "config.json").exists():
        return directory, layer_bytes
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        arrays = {k: (mx.random.normal(s) * 0.02).astype(mx.bfloat16) for k, s in shard.items()}
        mx.save_safetensors(str(directory / name), arrays, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        del arrays
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(text))
    return directory, layer_bytes


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


#: Runs argv as its only child and prints that child's peak RSS (kB): one fresh parent per measurement,
#: since RUSAGE_CHILDREN keeps the maximum over every child a process has waited for.
PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _measured(argv: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of *argv* in a subprocess."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PEAK, *argv], check=True, capture_output=True, text=True)
    return time.perf_counter() - started, int(result.stdout.strip()) / 1024


WHOLE = """import sys, mlx.core as mx
w = {}
for f in sys.argv[2:]:
    w.update({k: v for k, v in mx.load(f).items() if k.startswith("model.layers.1.")})
mx.eval(w); mx.save_safetensors(sys.argv[1], w)
"""
BARE = "import mlxcel.models.drafters.split, mlxcel.families.glm4_moe_lite.split"  # what split-mtp imports


def split(experts: int, vocab: int) -> None:
    raw, layer_bytes = _big_raw(experts, vocab)
    out = BENCH_DIR / "glm-split-out"
    shards = [str(raw / f"model-0000{i}-of-00003.safetensors") for i in (2, 3)]
    runs = [("split-mtp's imports, nothing read", [sys.executable, "-c", BARE]),
            ("split-mtp --q-bits 4", [sys.executable, "-m", "mlxcel", "split-mtp", "-m", str(raw), "-o", str(out),
                                      "--force", "--q-bits", "4"]),
            ("split-mtp (bf16 kept)", [sys.executable, "-m", "mlxcel", "split-mtp", "-m", str(raw), "-o", str(out),
                                       "--force"]),
            ("load the layer whole, save it", [sys.executable, "-c", WHOLE, str(BENCH_DIR / "whole.safetensors"),
                                               *shards])]
    print(f"next-token layer: {layer_bytes / 1e6:.0f} MB (bf16), {experts} experts, vocab {vocab}")
    print(f"{'run':<32} {'seconds':>8} {'peak RSS MB':>12}")
    for label, argv in runs:
        seconds, peak = _measured(argv)
        print(f"{label:<32} {seconds:>8.1f} {peak:>12.0f}", flush=True)
    (BENCH_DIR / "whole.safetensors").unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("speedup")
    s.add_argument("--k", type=int, nargs="+", default=[2, 3])
    s.add_argument("--tokens", type=int, default=128)
    p = commands.add_parser("split")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()
    if args.command == "speedup":
        speedup(args.k, args.tokens)
    else:
        split(args.experts, args.vocab)


if __name__ == "__main__":
    main()
