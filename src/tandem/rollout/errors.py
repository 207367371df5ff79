"""Exceptions for engine states (bad input raises ValueError instead)."""

from __future__ import annotations


class EngineAsleepError(RuntimeError):
    """The engine is asleep (its KV pool or weights released): call ``wake_up()`` before
    generating; or its weights were discarded (``sleep(2)``) and no full update has brought
    them back yet."""
