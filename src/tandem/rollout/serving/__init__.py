"""Serving: ``tandem serve`` (an OpenAI-compatible HTTP server with RL and weight-transfer
endpoints) and ``TandemClient``, the trainer's handle on it.

The only package that imports FastAPI, uvicorn and pydantic (the ``serve`` extra), and only
in the server's own modules: ``config`` and ``client`` import without them.
"""
