"""``parity inspect``: reverse-engineer a checkpoint's format."""


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint")


def run(args) -> int:
    raise SystemExit("parity inspect: not yet available")
