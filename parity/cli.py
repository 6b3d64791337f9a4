"""The ``parity`` command: inspect checkpoints, make fixtures."""

from __future__ import annotations

import argparse
import sys

from references.errors import ParityInputError


def _make_fixture(args: argparse.Namespace) -> int:
    from fixtures.checkpoints import Dims, make_fixture

    dims = Dims(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                intermediate=args.intermediate, vocab=args.vocab)
    out = make_fixture(args.format, args.out, seed=args.seed, dims=dims, dtype=args.dtype)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from fixtures.checkpoints import FORMATS, Dims
    from parity import inspect as inspect_cmd

    parser = argparse.ArgumentParser(prog="parity", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-fixture", help="write a deterministic tiny Llama checkpoint")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    d = Dims()
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="dtype of the floating-point tensors (embeddings, norms, lm_head)")
    p.set_defaults(func=_make_fixture)

    p = sub.add_parser("inspect", help="reverse-engineer a checkpoint's format")
    inspect_cmd.add_arguments(p)
    p.set_defaults(func=inspect_cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ParityInputError, ValueError) as exc:
        print(f"parity {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
