"""Exceptions for engine states (bad input raises ValueError instead)."""

from __future__ import annotations


class EngineAsleepError(RuntimeError):
    """The engine is asleep (its KV pool is freed): call ``wake_up()`` before generating."""
