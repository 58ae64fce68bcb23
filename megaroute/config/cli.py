"""`megaroute config show --config X [overrides]`: print the resolved config."""

from __future__ import annotations

import argparse

from . import ConfigError, load_config, to_yaml


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The --config FILE + trailing key=value overrides shared by every config-driven command."""
    parser.add_argument("--config", help="YAML config file (may use `base:` inheritance)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="dotted overrides")


def add_parser(sub) -> None:
    p = sub.add_parser("config", help="show the resolved config")
    # `show` is a sub-command rather than a positional choice: argparse matches consecutive
    # positionals greedily, so with `action` and `overrides` side by side the overrides after
    # `--config X` were rejected as "unrecognized arguments".
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print the resolved config as YAML")
    add_config_args(show)
    show.add_argument("--get", metavar="KEY", help="print one resolved value (dotted key, or run_dir)")
    show.set_defaults(func=run)


def run(args) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.get is None:
        print(to_yaml(cfg), end="")
        return 0
    value = cfg
    for part in args.get.split("."):
        if not hasattr(value, part):
            raise ConfigError(args.get, "no such key")
        value = getattr(value, part)
    print(value)
    return 0
