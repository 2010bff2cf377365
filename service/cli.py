"""The `sluice` command line. Each subcommand lives in its own module, listed in COMMANDS.

A command module defines `configure(parser)` (adds its arguments) and `run(args) -> int` (the exit code).
Only the module of the command being run is imported, so `sluice --help` and `sluice generate` stay
light (no torch, no server). Adding a subcommand means writing such a module and listing it here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

# name -> (module, help)
COMMANDS = {
    "serve": (
        "sluice.service.serve_command",
        "Serve a model over gRPC (health, reflection, /metrics, OpenTelemetry via OTEL_* variables).",
    ),
    "generate": (
        "sluice.service.generate_command",
        "Stream an answer from a Sluice server (the prompt is a chat message unless --raw); "
        "tokens/s and time to first token go to stderr.",
    ),
    "bench": (
        "sluice.bench.cli",
        "Benchmark a running Sluice server: TTFT, TPOT, ITL, latency percentiles, throughput, goodput.",
    ),
}


def load_commands(names: Sequence[str] = tuple(COMMANDS)) -> dict[str, ModuleType]:
    return {name: importlib.import_module(COMMANDS[name][0]) for name in names}


def build_parser(commands: dict[str, ModuleType]) -> argparse.ArgumentParser:
    """Every command is listed; the arguments of those in `commands` (name -> module) are added."""
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: gRPC LLM inference.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name in commands:
            commands[name].configure(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    commands = load_commands([chosen] if chosen in COMMANDS else [])
    args = build_parser(commands).parse_args(argv)
    return commands[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
