"""Moved to ``tandem.rollout.serving.client``; this import keeps the old path working."""

from .serving.client import ServerError, TandemClient

__all__ = ["ServerError", "TandemClient"]
