"""Every recipe key with its type, default and help, read from the config dataclasses: their
docstrings' ``Attributes:`` sections (``name: help``), and for ``rollout.engine`` the engine's
options (``EngineConfig``'s ``metadata["help"]``, as ``tandem serve --help`` shows them).

``tandem train --list-keys`` prints them.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from typing import Any

from tandem.rollout.config import EngineConfig

from .config import TrainConfig

_ATTRIBUTE = re.compile(r"^(\s*)(\w+): (.*)$")


@dataclass(frozen=True, slots=True)
class RecipeKey:
    """One dotted recipe key (``rollout.temperature``), its type, default and help."""

    key: str
    type: str
    default: Any
    help: str


def recipe_keys(config_class: type = TrainConfig, prefix: str = "") -> list[RecipeKey]:
    """Every key of ``config_class``, nested sections flattened to dotted keys, in field
    order; ``rollout.engine``'s engine options each as ``rollout.engine.NAME``."""
    docs, hints = attribute_docs(config_class), typing.get_type_hints(config_class)
    keys = []
    for field in dataclasses.fields(config_class):
        name, hint = prefix + field.name, hints[field.name]
        if dataclasses.is_dataclass(hint):
            keys += recipe_keys(hint, name + ".")
            continue
        keys.append(RecipeKey(name, _type_name(hint), _default(field), docs.get(field.name, "")))
        if name == "rollout.engine":
            keys += _engine_keys(name + ".")
    return keys


def attribute_docs(config_class: type) -> dict[str, str]:
    """``name: help`` of the class docstring's ``Attributes:`` section, continuation lines
    joined."""
    docs, current, indent, inside = {}, None, None, False
    for line in (config_class.__doc__ or "").splitlines():
        if line.strip() == "Attributes:":
            inside = True
            continue
        if not inside or not line.strip():
            continue
        match = _ATTRIBUTE.match(line)
        if match and (indent is None or len(match[1]) == indent):
            indent, current = len(match[1]), match[2]
            docs[current] = match[3].strip()
        elif current is not None and len(line) - len(line.lstrip()) > indent:
            docs[current] += " " + line.strip()
        else:
            break
    return docs


def format_keys(keys: list[RecipeKey]) -> str:
    """The keys as ``tandem train --list-keys`` prints them: one per line with its type
    and default, its help indented below."""
    lines = []
    for item in keys:
        lines.append(f"{item.key} ({item.type}, default: {item.default!r})")
        if item.help:
            lines.append(f"    {item.help}")
    return "\n".join(lines)


def _engine_keys(prefix: str) -> list[RecipeKey]:
    hints = typing.get_type_hints(EngineConfig)
    return [RecipeKey(prefix + field.name, _type_name(hints[field.name]), _default(field),
                      field.metadata.get("help", ""))
            for field in dataclasses.fields(EngineConfig) if field.name != "model"]


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) if isinstance(hint, type) else \
        str(hint).replace("typing.", "")
