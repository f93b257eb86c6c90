"""The ``mlxcel`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from .usage import EXIT_USAGE, UsageError

#: The model could not be loaded after the port was bound: the same status as a bad setting.
EXIT_LOAD_FAILED = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line on stderr (argparse adds the whole usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _policy(args: argparse.Namespace) -> int:
    from .client import PolicyFetchError, fetch, render

    try:
        body = fetch(args.url, api_key=args.api_key, model=args.model)
    except PolicyFetchError as exc:
        print(f"mlxcel policy: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    text = render(body)
    if text is None:
        version = body.get("schema_version") if isinstance(body, dict) else None
        print(f"mlxcel policy: the server answered schema_version {version!r}, which this client "
              "cannot read; showing nothing", file=sys.stderr)
        return 1
    print(text)
    return 0


def _statechart(args: argparse.Namespace) -> int:
    from . import _docgen
    from .policy.statechart import render_mermaid

    root = Path(args.root)
    if args.check:
        stale = _docgen.stale(root)
        for path in stale:
            print(f"mlxcel statechart: {path} is stale; run `mlxcel statechart --write`",
                  file=sys.stderr)
        return 1 if stale else 0
    if args.write:
        for path in _docgen.write(root):
            print(f"wrote {path}")
        return 0
    sys.stdout.write(render_mermaid())
    return 0


def _split_mtp(args: argparse.Namespace) -> int:
    from .blas import load_fast_blas
    from .config import ConfigError, parse_draft_block_size

    try:
        block_size = None if args.block_size is None else parse_draft_block_size("--block-size", args.block_size)
    except ConfigError as exc:
        print(f"mlxcel split-mtp: {exc}", file=sys.stderr)
        return EXIT_USAGE
    load_fast_blas()  # before mlx is imported, as everywhere
    from .checkpoints import split_mtp
    from .models.drafters.loader import DrafterError

    try:
        quantize = None if args.q_bits is None else (args.q_bits, args.q_group_size)
        split_mtp(args.model.expanduser(), args.out.expanduser(), block_size=block_size, force=args.force,
                  quantize=quantize, report=lambda line: print(f"mlxcel split-mtp: {line}", file=sys.stderr))
    except (DrafterError, OSError) as exc:
        print(f"mlxcel split-mtp: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _config(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_env

    try:
        env = load_env()
    except ConfigError as exc:
        print(f"mlxcel: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps({
        "adaptive": env.policy.adaptive,
        "pin": env.policy.pin,
        "allow_inexact": env.policy.allow_inexact,
        "samples_required": env.policy.samples_required,
        "draft_block_size": env.draft_block_size,
        "cache_root": str(env.cache_root),
    }, indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The statechart library narrates every callback at INFO; our policy logs what matters.
    logging.getLogger("transitions").setLevel(logging.WARNING)
    from .router.options import node_role

    try:
        role = node_role(args)
    except UsageError as exc:
        print(f"mlxcel serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if role == "router":  # no model, no mlx: docs/scaling.md
        from .router.serve import serve_router

        return serve_router(args)
    from .serve import ServeConfig
    from .serve_cli import build_serve_config

    try:
        config = build_serve_config(args)
    except UsageError as exc:
        print(f"mlxcel serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # A rank other than 0 serves no HTTP: it follows.
    if isinstance(config, ServeConfig) and config.worker.sharding is not None and not config.worker.sharding.leader:
        from .distributed.follower import run_follower

        sharding = config.worker.sharding
        try:
            run_follower(config.checkpoint, sharding)
        except Exception as exc:
            print(f"mlxcel serve: rank {sharding.rank}: stopped: {exc}", file=sys.stderr)
            return EXIT_LOAD_FAILED
        return 0
    import trio

    from .serve import main as serve_main

    try:
        trio.run(serve_main, config)
    except BaseException as exc:  # the model failed to load after the port was bound, or an interrupt
        from .http.signals import first_error, interrupted

        if interrupted(exc):
            return 0
        print(f"mlxcel serve: stopped: {first_error(exc)}", file=sys.stderr)
        return EXIT_LOAD_FAILED
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlxcel", description="LLM inference server on MLX.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a Hugging Face-layout model directory with continuous batching.")
    from .serve_args import add_serve_arguments

    add_serve_arguments(serve)
    serve.set_defaults(run=_serve)

    policy = commands.add_parser(
        "policy", help="show a running server's adaptive MTP policy",
        description="Fetch GET /v1/internal/mtp-policy and render it for a person.")
    policy.add_argument("--url", default="http://127.0.0.1:8080",
                        help="the server's base URL (default: %(default)s)")
    policy.add_argument("--api-key", help="API key, sent as a bearer token")
    policy.add_argument("--model", help="on a server of several models (--models, --model-dir): this model's policy "
                                        "(default: the first model's)")
    policy.add_argument("--json", action="store_true", help="print the body as JSON instead")
    policy.set_defaults(run=_policy)

    chart = commands.add_parser(
        "statechart", help="render the MTP policy statechart",
        description="Print the policy statechart as mermaid, or regenerate the committed "
                    "diagram and docs from it.")
    mode = chart.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true",
                      help="regenerate statecharts/ and the generated block of docs/statechart.md")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 if the committed diagram or docs are stale")
    chart.add_argument("--root", default=".", help="the repository root (default: %(default)s)")
    chart.set_defaults(run=_statechart)

    split = commands.add_parser(
        "split-mtp", help="extract a raw checkpoint's MTP head into a standalone drafter directory",
        description="Write the MTP head of a raw checkpoint (Qwen's mtp.* tensors, GLM-4.7-Flash's "
                    "model.layers.{num_hidden_layers}.* next-token layer) as a standalone drafter "
                    "directory for --draft-model: config.json, model.safetensors and the tokenizer files. "
                    "Conversions that dropped the head (quantized ones, mlx-lm's) can then be served with it.")
    split.add_argument("-m", "--model", type=Path, required=True, metavar="RAW_DIR",
                       help="the raw checkpoint, with its MTP tensors")
    split.add_argument("-o", "--out", type=Path, required=True, metavar="OUT_DIR", help="the drafter directory")
    split.add_argument("--block-size", metavar="N",
                       help="the K the drafter's config names (2 to 32; default: 3 for Qwen, "
                            "num_nextn_predict_layers + 1 = 2 for GLM)")
    split.add_argument("--q-bits", type=int, choices=(2, 3, 4, 5, 6, 8), metavar="B",
                       help="GLM only: affine-quantize the layer's matrices to B bits (2, 3, 4, 5, 6 or 8; "
                            "the router gate stays exact)")
    split.add_argument("--q-group-size", type=int, choices=(32, 64, 128), default=64, metavar="G",
                       help="the quantization group size (32, 64 or 128; default %(default)s)")
    split.add_argument("--force", action="store_true", help="replace a checkpoint already in OUT_DIR")
    split.set_defaults(run=_split_mtp)

    config = commands.add_parser(
        "config", help="show the settings the MLXCEL_* environment variables resolve to",
        description="Parse the MLXCEL_* environment variables as `mlxcel serve` would and print "
                    "the result; a malformed value exits with status 2.")
    config.set_defaults(run=_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
