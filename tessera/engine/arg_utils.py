"""The engine flags on a command line: one flag per `EngineArgs` field (tessera/config.py).

Here, below both CLIs, because `tessera serve` (tessera/entrypoints/cli.py) and `tessera
simulate` (tessera/simulator/cli.py) take the same flags; vLLM keeps these in its
`engine/arg_utils.py` too. Argparse only: importing this loads no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from tessera.config import EngineArgs, flag_name


def _base_type(annotation) -> type:
    """`int | None` -> int; `str` -> str."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        assert len(args) == 1, f"unsupported flag type {annotation}"
        return args[0]
    return annotation


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per `EngineArgs` field, in declaration order (less the `exclude`d fields: the
    simulator names its model and device otherwise)."""
    group = parser.add_argument_group("engine", "engine flags (see tessera.config.EngineArgs)")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name in exclude:
            continue
        help_text = f.metadata.get("help", "")
        if f.metadata.get("json"):  # a JSON object on the command line, a dict from Python
            group.add_argument(flag_name(f.name), type=str, default=f.default, help=help_text,
                               metavar="JSON")
            continue
        kind = _base_type(hints[f.name])
        if kind is bool:
            if f.default:
                group.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction,
                                   default=True, help=help_text)
            else:
                group.add_argument(flag_name(f.name), action="store_true", help=help_text)
            continue
        if f.default is not None:
            help_text += " (default: %(default)s)"
        group.add_argument(flag_name(f.name), *f.metadata.get("aliases", ()), type=kind,
                           default=f.default,
                           choices=f.metadata.get("choices"), help=help_text,
                           metavar=None if f.metadata.get("choices") else f.name.upper())


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The EngineArgs of parsed flags (fields without a flag keep their defaults)."""
    args = {name: getattr(ns, name) for name in EngineArgs.field_names() if hasattr(ns, name)}
    if getattr(ns, "model_tag", None) is not None:  # `tessera serve MODEL`
        args["model"] = ns.model_tag
    return EngineArgs(**args)
