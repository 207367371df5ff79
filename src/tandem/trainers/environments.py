"""Environments for multi-turn episodes: the protocol, and tools built from Python functions.

An episode alternates model turns and environment steps: ``reset`` gives the first messages
from a dataset example; after each model turn, ``step`` gets the conversation so far (ending
with the model's message) and answers with the next observation messages, a reward and
whether the episode is done.

``ToolEnvironment`` answers tool calls. Calls are parsed from the model's text in the
Hermes/Qwen format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the one
Qwen's chat templates teach; SmolLM2's template has none, so a system prompt teaches it) by
the engine's parser (``tandem.rollout.tool_calls``, the server's too),
each tool's JSON schema comes from its signature and docstring (transformers'
``get_json_schema``), and every failure (bad JSON, an unknown tool, wrong arguments, a tool
that raises or runs past its timeout) becomes an error observation the model can read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from transformers.utils import get_json_schema

from tandem.rollout.tool_calls import MalformedToolCall, ToolCall, parse_tool_calls

Message = dict[str, Any]


@dataclass(slots=True)
class EnvStep:
    """An environment's answer to one model turn.

    Attributes:
        messages: the observation messages to append (e.g. ``{"role": "tool", ...}``).
        reward: the step's reward (the task's reward functions score the whole episode too).
        done: the episode ends here (the model's turn was its final answer).
        metrics: counts to log (``tool_calls``, ``tool_errors``).
    """

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class Environment(Protocol):
    """What an episode's environment offers."""

    def reset(self, example: Mapping[str, Any]) -> list[Message]:
        """The episode's first messages for a dataset example."""

    def step(self, messages: list[Message]) -> EnvStep:
        """The answer to the conversation so far, which ends with the model's message."""


def check_step(step: Any, environment: object) -> EnvStep:
    """``step`` when it is an ``EnvStep`` of well-formed messages.

    Raises:
        ValueError: naming the environment, for anything else.
    """
    name = type(environment).__name__
    if not isinstance(step, EnvStep):
        raise ValueError(f"{name}.step returned {type(step).__name__}, not an EnvStep.")
    for message in step.messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{name}.step returned {message!r}, not a message (a dict with "
                             "a string role and content).")
    return step


class ToolEnvironment:
    """Answers the model's tool calls with the results of plain Python functions.

    Args:
        tools: the functions (typed, with Google-style docstrings for their schemas).
        timeout: seconds a call may run; a slower one becomes an error observation (its
            thread is left to finish in the background).
        system_prompt: an optional system message put before the example's messages (where
            the chat template cannot render tools, it is where the format is taught).
    """

    def __init__(self, tools: list[Callable[..., Any]], timeout: float = 10.0,
                 system_prompt: str | None = None) -> None:
        self.tools = {tool.__name__: tool for tool in tools}
        self.schemas = [get_json_schema(tool) for tool in tools]
        self.timeout = timeout
        self.system_prompt = system_prompt

    def reset(self, example: Mapping[str, Any]) -> list[Message]:
        """The system prompt (if any), then the example's prompt as messages."""
        prompt = example["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [dict(m) for m in messages]

    def step(self, messages: list[Message]) -> EnvStep:
        """Run every tool call of the model's last message; no call ends the episode."""
        calls = parse_tool_calls(messages[-1]["content"]).calls
        if not calls:
            return EnvStep(done=True, metrics={"tool_calls": 0.0, "tool_errors": 0.0})
        results = [self._answer(call) for call in calls]
        errors = sum(result.startswith("error:") for result in results)
        return EnvStep(messages=[{"role": "tool", "content": result} for result in results],
                       metrics={"tool_calls": float(len(calls)), "tool_errors": float(errors)})

    def _answer(self, call: ToolCall | MalformedToolCall) -> str:
        """A call's result as text, or ``error: ...`` saying what went wrong."""
        if isinstance(call, MalformedToolCall):
            return f"error: the tool call is not JSON with a name and arguments ({call.error})."
        name, arguments = call.name, call.arguments
        tool = self.tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}; tools: {', '.join(self.tools)}."
        outcome: dict[str, Any] = {}
        thread = threading.Thread(target=_call, args=(tool, arguments, outcome), daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():  # left to finish in the background; its result is dropped
            return f"error: {name} ran past its {self.timeout} s timeout."
        error = outcome.get("error")
        if isinstance(error, TypeError):
            return f"error: wrong arguments for {name}: {error}."
        if error is not None:  # the tool's own failure is the model's to read
            return f"error: {name} raised {type(error).__name__}: {error}."
        return str(outcome["value"])


def _call(tool: Callable[..., Any], arguments: dict[str, Any], outcome: dict[str, Any]) -> None:
    try:
        outcome["value"] = tool(**arguments)
    except Exception as exc:
        outcome["error"] = exc
