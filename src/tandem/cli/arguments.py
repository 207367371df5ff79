"""Config dataclass → command-line options: one ``--field-name`` per field, its type from the
annotation and its help from the field's ``metadata["help"]`` (as TRL builds its CLI)."""

from __future__ import annotations

import argparse
import dataclasses
import typing

ARGUMENT_TYPES = (bool, int, float, str)


def add_config_arguments(parser: argparse.ArgumentParser, config_class: type,
                         skip: set[str] = frozenset()) -> None:
    """Add one ``--field-name`` option per field of ``config_class`` (but those in ``skip``),
    typed from its annotation, documented from its ``metadata["help"]``, defaulting to the
    field's default; a ``bool`` becomes ``--name/--no-name``."""
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        if field.name in skip:
            continue
        kind = _argument_type(hints[field.name])
        options = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        parser.add_argument(f"--{field.name.replace('_', '-')}", default=field.default,
                            help=f"{field.metadata.get('help', '')} (default: {field.default})",
                            **options)


def config_from_arguments(config_class: type, args: argparse.Namespace) -> typing.Any:
    """Build ``config_class`` from the parsed options ``add_config_arguments`` added.

    Raises:
        ValueError: as ``config_class`` does for an invalid value.
    """
    names = {field.name for field in dataclasses.fields(config_class)}
    return config_class(**{name: value for name, value in vars(args).items() if name in names})


def _argument_type(hint: typing.Any) -> type:
    """The command-line type of an annotation: the first of bool, int, float, str in it."""
    candidates = typing.get_args(hint) or (hint,)
    return next(kind for kind in candidates if kind in ARGUMENT_TYPES)
