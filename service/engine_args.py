"""`sluice serve`'s engine flags, built from the config dataclasses' fields (`sluice.engine.config.option`):
one flag per field, named after it (`max_num_seqs` -> `--max-num-seqs`) unless the field names its flag, with
the field's default, type, choices and help. The config module stays the one source of truth; this module only
spells it for argparse.

    ModelConfig.dtype: str = option("auto", "...", choices=DTYPES)   ->  --dtype {auto,float32,...}
    CacheConfig.enable_prefix_caching: bool = option(True, ..., flag="no-prefix-caching")
                                                                     ->  --no-prefix-caching (store_false)
    EngineConfig.async_scheduling: bool | None = option(None, ...)   ->  --async-scheduling and
                                                                         --no-async-scheduling (unset: None)
    EngineConfig.speculative: SpeculativeConfig | None               ->  its section's flags; the section
                                                                         exists when its first flag is given
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, Field, fields
from types import UnionType
from typing import Any, get_args, get_origin, get_type_hints

from sluice.engine.config import EngineConfig, config_sections

_SIZE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '2G', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r} (e.g. 4GiB, 512MiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()])


def flag_name(f: Field) -> str:
    return f.metadata.get("flag") or f.name.replace("_", "-")


def _dest(section: str | None, f: Field) -> str:
    """The parsed value's attribute: the field's own name (`args.max_num_seqs`, `args.enable_prefix_caching`);
    names are unique across the sections (`add_engine_arguments` checks)."""
    return f.name


def _scalar_type(hint: Any) -> type:
    """int | None -> int; str -> str."""
    members = [m for m in get_args(hint) if m is not type(None)] if get_origin(hint) is UnionType else [hint]
    if len(members) != 1 or members[0] not in (int, float, str, bool):
        raise TypeError(f"no command-line form for a field typed {hint}")
    return members[0]


def _add_flag(
    parser: argparse._ActionsContainer,
    groups: dict[str, Any],
    section: str | None,
    f: Field,
    hint: Any,
    switches_section_on: bool = False,
    in_optional_section: bool = False,
) -> None:
    meta = f.metadata
    kind = _scalar_type(hint)
    # An optional section's first flag has no default: giving it is what makes the section exist. Its
    # other flags parse to None when not given, so that one given without the first is refused even at
    # its default value (the field's default then applies: `engine_config_from_args`).
    unset = switches_section_on or in_optional_section
    default = None if unset or f.default is MISSING else f.default
    target = parser
    if meta.get("exclusive"):
        if meta["exclusive"] not in groups:
            groups[meta["exclusive"]] = parser.add_mutually_exclusive_group()
        target = groups[meta["exclusive"]]
    name, dest = f"--{flag_name(f)}", _dest(section, f)
    if kind is bool and default is None and f.default is None and not unset:  # unset: the engine decides
        target.add_argument(
            name, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=meta["help"]
        )
        return
    if kind is bool:
        if default and not flag_name(f).startswith("no-"):
            raise TypeError(f"{f.name}: a field that defaults to True needs a flag='no-...' to switch it off")
        action = "store_false" if default else "store_true"
        target.add_argument(name, dest=dest, action=action, default=default, help=meta["help"])
        return
    parse = parse_size if meta.get("unit") == "bytes" else kind
    help_text = meta["help"]
    if default is not None and "default" not in help_text:
        help_text += " (default: %(default)s)"
    elif in_optional_section and f.default is not None and "default" not in help_text:
        help_text += f" (default: {f.default})"
    metavar = None if meta.get("choices") else flag_name(f).upper().replace("-", "_")
    target.add_argument(
        name,
        dest=dest,
        type=parse,
        default=default,
        choices=meta.get("choices"),
        metavar=metavar,
        help=help_text,
    )


def add_engine_arguments(parser: argparse.ArgumentParser, config: type = EngineConfig) -> None:
    """Adds one flag per `option` field of `config` and its sections, a group per section."""
    sections = config_sections(config)
    names = [f.name for s in sections.values() for f in fields(s.cls) if "help" in f.metadata]
    names += [f.name for f in fields(config) if f.name not in sections and "help" in f.metadata]
    if len(names) != len(set(names)):
        raise TypeError(
            f"option fields share a name across sections: {sorted({n for n in names if names.count(n) > 1})}"
        )
    for name, section in sections.items():
        summary = (section.cls.__doc__ or "").strip().split("\n\n")[0]
        group = parser.add_argument_group(name, " ".join(summary.split()))
        hints, groups = get_type_hints(section.cls), {}
        first = _first_option(section.cls)
        for f in fields(section.cls):
            if "help" in f.metadata:
                on = section.optional and f is first
                within = section.optional and f is not first
                _add_flag(
                    group, groups, name, f, hints[f.name], switches_section_on=on, in_optional_section=within
                )
    group = parser.add_argument_group("engine")
    hints = get_type_hints(config)
    for f in fields(config):
        if f.name not in sections and "help" in f.metadata:
            _add_flag(group, {}, None, f, hints[f.name])


def _first_option(cls: type) -> Field:
    return next(f for f in fields(cls) if "help" in f.metadata)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` the flags of `add_engine_arguments` describe. An optional section's other flags
    without its first one raise ValueError naming the flag."""
    values = vars(args)
    built: dict[str, Any] = {}
    for name, section in config_sections(EngineConfig).items():
        kwargs = {f.name: values[_dest(name, f)] for f in fields(section.cls) if "help" in f.metadata}
        if section.optional:
            first = _first_option(section.cls)
            given = [f for f in fields(section.cls) if kwargs.get(f.name) is not None]
            if kwargs[first.name] is None:
                if given:
                    raise ValueError(f"{flag_name(given[0])}: needs --{flag_name(first)}")
                built[name] = None
                continue
            kwargs = {f.name: kwargs[f.name] for f in given}  # the others keep the field's default
        built[name] = section.cls(**kwargs)
    top = {
        f.name: values[_dest(None, f)]
        for f in fields(EngineConfig)
        if f.name not in built and "help" in f.metadata
    }
    return EngineConfig(**built, **top)
