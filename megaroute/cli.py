"""The `megaroute` command. Each subcommand lives in its own module and registers itself."""

from __future__ import annotations

import argparse
import importlib
import sys

from .config import ConfigError

# name -> module exposing `add_parser(subparsers)`; imported lazily so `megaroute --help`
# stays fast and a subcommand's heavy dependencies load only when it runs.
SUBCOMMANDS = {
    "config": "megaroute.config.cli",
    "inspect": "megaroute.inspect",
    "data": "megaroute.data.cli",
    "sweep": "megaroute.sweep.cli",
    "compare": "megaroute.sweep.compare",
    "convert": "megaroute.hf.convert",
    "audit": "megaroute.audit.cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """`command` (a subcommand's name): only its module is imported and registered; None or any
    other word (--help, a typo): all of them, for the full list."""
    parser = argparse.ArgumentParser(prog="megaroute", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        if command not in SUBCOMMANDS or name == command:
            importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"megaroute: error: {e}", file=sys.stderr)
        return 2
    except LookupError as e:  # a named run, experiment or sweep that does not exist
        print(f"megaroute: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
