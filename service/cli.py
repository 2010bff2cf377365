"""The `sluice` command line. Each subcommand lives in its own module, listed in COMMAND_MODULES.

A command module defines NAME, HELP, `configure(parser)` (adds its arguments) and `run(args) -> int`
(the exit code). Adding a subcommand means writing such a module and listing it here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

COMMAND_MODULES = (
    "service.serve_command",
    "service.generate_command",
    "sluice.bench.cli",
)


def load_commands(module_names: Sequence[str] = COMMAND_MODULES) -> dict[str, ModuleType]:
    commands = {}
    for module_name in module_names:
        module = importlib.import_module(module_name)
        commands[module.NAME] = module
    return commands


def build_parser(commands: dict[str, ModuleType]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: gRPC LLM inference.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in commands.items():
        sub = subparsers.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    commands = load_commands()
    args = build_parser(commands).parse_args(argv)
    return commands[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
