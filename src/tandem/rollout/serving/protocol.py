"""The request bodies every route takes, as pydantic models (validated before a route runs).

OpenAI's completions and chat completions take every ``SamplingParams`` field under its own
name (vLLM's extras ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ... included): the fields are read from the dataclass, so a field added
there is a request field too. Only the fields whose OpenAI shape differs are declared here:
``max_tokens`` (optional, the route picks the default), ``logprobs`` (a count for
completions, a flag plus ``top_logprobs`` for chat), ``stop`` (a string or a list) and
``stop_token_ids`` (null allowed). ``structured_outputs`` is vLLM's object; OpenAI's
``response_format`` (``json_object``, ``json_schema``) says the same in its shape. Chat
completions take OpenAI's typed ``messages`` (messages.py), ``tools`` and ``tool_choice``
(``required`` and a named function force the tool-call format through a structural tag).
Tandem adds ``timeout`` to every generating body. Both take vLLM's ``echo`` (the prompt, or
the last message, before each completion), ``prompt_logprobs`` and
``return_tokens_as_token_ids``; every other field of vLLM's or OpenAI's these bodies do not
honour is in ``unhonoured.py``, refused with a 400 naming it and why, never taken and
ignored (unless its value changes nothing). Chat completions and ``/tokenize`` take
vLLM's chat-template options (``continue_final_message``, ``chat_template_kwargs``,
``add_special_tokens``). Then the bodies of vLLM's ``/tokenize`` (a ``prompt`` or
``messages``) and ``/detokenize``, and Tandem's own: ``/v1/rollouts`` and the
weight-transfer endpoints (vLLM's shapes).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    create_model,
    field_validator,
    model_validator,
)

from ..input_processor import Prompt
from ..llm import as_prompt_list, params_per_prompt
from ..sampling_params import SamplingParams
from ..structured_outputs import INSTALL_HINT, StructuredOutputsParams, as_structured_outputs
from .errors import APIError
from .messages import ChatMessage, templated
from .responses import ChoiceForm
from .unhonoured import UNHONOURED

TIMEOUT = Field(default=None, gt=0, allow_inf_nan=False, description=(
    "Tandem's extension: seconds this request may take from when it is queued; the server's "
    "--request-timeout applies when smaller. Past it the request is aborted and answered "
    "504 (a stream ends with an error event)."))
# vLLM's chat-template options, for chat completions and /tokenize alike.
CONTINUE_FINAL_MESSAGE = Field(default=False, description=(
    "vLLM's: leave the last message open (no end-of-turn marker after its content), so the "
    "model continues it, a prefill; excludes add_generation_prompt (set it to false)."))
CHAT_TEMPLATE_KWARGS = Field(default=None, description=(
    "vLLM's: further variables the chat template reads (such as Qwen 3's enable_thinking); "
    "not apply_chat_template's own arguments (tokenize, chat_template, ...)."))
CHAT_ADD_SPECIAL_TOKENS = Field(default=False, description=(
    "vLLM's: add the tokenizer's special tokens (such as BOS) on top of those the chat "
    "template writes (most templates write them all: leave it false)."))
# The schema says what the server refuses: no empty prompt, text or list, no negative id
# (a fuzzer's schema-valid request must be one the server takes).
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
OnePrompt = Text | TokenIds
# Set by each route in its OpenAI shape, then passed to ``SamplingRequest.sampling_params``.
ROUTE_CHOSEN = ("max_tokens", "logprobs")
OPENAI_SHAPED = (*ROUTE_CHOSEN, "stop", "stop_token_ids")




def _request_field(field: dataclasses.Field, hint: Any) -> tuple[Any, Any]:
    """A dataclass field as pydantic's ``(type, Field)``, its help as the description.

    ``structured_outputs`` takes its JSON object (strict mode would want an instance).
    """
    kwargs = {"description": field.metadata.get("help")}
    if field.name == "structured_outputs":
        hint = Annotated[hint, BeforeValidator(as_structured_outputs)]
    if field.default_factory is not dataclasses.MISSING:
        return hint, Field(default_factory=field.default_factory, **kwargs)
    if field.default is not dataclasses.MISSING:
        return hint, Field(default=field.default, **kwargs)
    return hint, Field(**kwargs)


def _sampling_fields() -> dict[str, tuple[Any, Any]]:
    """Every ``SamplingParams`` field in the same shape, but those in OpenAI's own."""
    hints = typing.get_type_hints(SamplingParams)
    return {field.name: _request_field(field, hints[field.name])
            for field in dataclasses.fields(SamplingParams) if field.name not in OPENAI_SHAPED}


# strict: a field takes its JSON type only (no "2" or 2.0 for an int, no 1 for a bool), as
# the schema says; a float still takes an integer.
_SamplingFields = create_model("SamplingFields",
                               __config__=ConfigDict(extra="ignore", strict=True),
                               **_sampling_fields())


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema (``name`` and ``strict`` are OpenAI's
    labels; the schema is always enforced)."""

    model_config = ConfigDict(strict=True)  # JSON types only, as the request's own fields

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (the given schema)."""

    model_config = ConfigDict(strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The same constraint as ``StructuredOutputsParams`` (None for ``text``).

        Raises:
            APIError: for ``json_schema`` without its ``json_schema`` object.
        """
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise APIError(400, "response_format type json_schema needs its json_schema "
                           "object ({name, schema}).", param="response_format")
        return StructuredOutputsParams(json=self.json_schema.schema_)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingRequest(_SamplingFields):
    """The fields completions and chat completions share: the model, every ``SamplingParams``
    field (those in OpenAI's shape declared here), streaming, ``return_token_ids`` and
    ``return_tokens_as_token_ids``; a field in ``UNHONOURED`` is refused."""

    model: str | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = Field(default=False, description=(
        "vLLM's: name each log-prob token token_id:N instead of its text (a token that is "
        "no whole UTF-8 character stays identifiable)."))
    response_format: ResponseFormat | None = None
    timeout: float | None = TIMEOUT

    @model_validator(mode="before")
    @classmethod
    def _refuse_unhonoured(cls, body: Any) -> Any:
        """Refuse a field of ``UNHONOURED`` holding a value that would change anything.

        Raises:
            APIError: 400 naming the field and why.
        """
        if not isinstance(body, dict):
            return body
        for name, unhonoured in UNHONOURED.items():
            if (name in body and name not in cls.model_fields
                    and not unhonoured.harmless(body[name], body)):
                raise APIError(400, f"{name} is not supported by this server: "
                               f"{unhonoured.why}. Leave it out.", param=name)
        return body

    @field_validator("stop", "stop_token_ids")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return value or []

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The ``SamplingParams`` of this request with the route's ``max_tokens`` and
        ``logprobs`` (validated: ValueError names the field).

        Raises:
            APIError: for two constraints at once (see ``constraint``), or
                ``prompt_logprobs`` in a stream.
        """
        if self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs are not sent in a stream (as vLLM's): leave "
                           "out stream or prompt_logprobs.", param="prompt_logprobs")
        fields = {field.name: getattr(self, field.name)
                  for field in dataclasses.fields(SamplingParams)
                  if field.name not in ROUTE_CHOSEN}
        fields["structured_outputs"] = self.constraint()
        return SamplingParams(**fields, max_tokens=max_tokens, logprobs=logprobs)

    def choice_form(self, params: SamplingParams) -> ChoiceForm:
        """How this request's choices are written, given its ``params``."""
        return ChoiceForm(return_token_ids=self.return_token_ids,
                          token_id_names=self.return_tokens_as_token_ids,
                          top_logprobs=params.logprobs or 0)

    def constraint(self) -> StructuredOutputsParams | None:
        """What the completions must match: ``structured_outputs`` or ``response_format``.

        Raises:
            APIError: when both constrain.
        """
        given = [c for c in (self.structured_outputs, self.response_format
                             and self.response_format.structured_outputs()) if c is not None]
        if len(given) > 1:
            raise APIError(400, "structured_outputs and response_format both constrain the "
                           "output: give one.", param="response_format")
        return given[0] if given else None

    @property
    def include_usage(self) -> bool:
        """True when a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt or several, each text or token ids."""

    prompt: OnePrompt | Annotated[list[Text], Field(min_length=1)] | \
        Annotated[list[TokenIds], Field(min_length=1)]
    logprobs: int | None = None
    echo: bool = Field(default=False, description=(
        "each choice starts with its prompt: the text, and with logprobs the prompt's tokens "
        "and log-probs (raw: the model's, given the tokens before) before the completion's; "
        "with max_tokens 0 the prompt alone is scored and nothing generated."))

    def prompts(self) -> list[Prompt]:
        """The prompts as a list (a single text or token-id list becomes one)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def scores_prompt_only(self) -> bool:
        """True for ``echo`` with ``max_tokens`` 0: the prompt scored, nothing generated
        shown (the engine samples one token, left out, as vLLM's)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """As ``SamplingRequest.sampling_params``; with ``echo`` and ``logprobs`` the prompt
        is scored too (``prompt_logprobs`` defaults to ``logprobs``, as vLLM's), and
        ``scores_prompt_only`` samples one token.

        Raises:
            APIError, ValueError: as ``SamplingRequest.sampling_params``.
        """
        params = super().sampling_params(1 if self.scores_prompt_only else max_tokens,
                                         logprobs)
        if self.echo and params.prompt_logprobs is None and logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=logprobs)
        return params

    def choice_form(self, params: SamplingParams) -> ChoiceForm:
        """As ``SamplingRequest.choice_form``, with the prompt echoed when asked."""
        return dataclasses.replace(super().choice_form(params), echo=self.echo,
                                   prompt_only=self.scores_prompt_only)


class FunctionDefinition(BaseModel):
    """A tool's function: its name, description and JSON-schema ``parameters`` (further
    fields, such as ``strict``, are kept and reach the chat template too)."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionToolsParam(BaseModel):
    """One of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionNamedFunction(BaseModel):
    """The function a named ``tool_choice`` names."""

    name: str


class ChatCompletionNamedToolChoiceParam(BaseModel):
    """``tool_choice`` naming a function: ``{"type": "function", "function": {"name"}}``."""

    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: a conversation, with the model's chat template applied
    (and ``tools`` rendered by it)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = CONTINUE_FINAL_MESSAGE
    chat_template_kwargs: dict[str, Any] | None = CHAT_TEMPLATE_KWARGS
    add_special_tokens: bool = CHAT_ADD_SPECIAL_TOKENS
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: (Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam
                  | None) = None
    echo: bool = Field(default=False, description=(
        "vLLM's: each reply starts with the last message's content when that message has "
        "the reply's role (assistant; without add_generation_prompt, the last message's own)."))

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template reads them: each content as plain text (text
        parts joined), and the arguments of each assistant tool call, a JSON string in
        OpenAI's shape, as the object they encode (as vLLM passes them).

        Raises:
            APIError: for tool-call arguments that are not JSON.
        """
        return [templated(message) for message in self.messages]

    def choice_form(self, params: SamplingParams) -> ChoiceForm:
        """As ``SamplingRequest.choice_form``; with ``echo``, the text each reply starts with
        (vLLM's: the last message's content when its role is the reply's, else none)."""
        form = super().choice_form(params)
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.role
        if not self.echo or last.role != role:
            return form
        return dataclasses.replace(form, chat_echo=templated(last)["content"])

    def constraint(self) -> StructuredOutputsParams | None:
        """As ``SamplingRequest.constraint``; a ``required`` or named ``tool_choice`` forces
        the tool-call format (``tool_calls.py``'s) with an xgrammar structural tag.

        Raises:
            APIError: for a forced tool call with another constraint, or without xgrammar.
        """
        constraint = super().constraint()
        if self.tool_choice in (None, "auto", "none"):
            return constraint
        if constraint is not None:
            raise APIError(400, f"tool_choice {self.tool_choice!r} already constrains the "
                           "output: leave out structured_outputs and response_format.",
                           param="tool_choice")
        return StructuredOutputsParams(structural_tag=self._tool_call_tag())

    def _tool_call_tag(self) -> str:
        try:
            import xgrammar
        except ImportError as exc:
            raise APIError(400, f"a forced tool_choice needs xgrammar: {INSTALL_HINT}.",
                           param="tool_choice") from exc
        choice = self.tool_choice
        named = isinstance(choice, ChatCompletionNamedToolChoiceParam)
        # Qwen 3's format with reasoning off is the Hermes block tool_calls.py parses.
        tag = xgrammar.get_builtin_structural_tag(
            "qwen_3", tools=[tool.model_dump(exclude_unset=True) for tool in self.tools],
            tool_choice=choice.model_dump() if named else choice, reasoning="disabled",
            parallel_tool_calls=not named)
        return tag.model_dump_json()

    @property
    def parses_tool_calls(self) -> bool:
        """True when the completions' tool calls are parsed: tools given, tool_choice not
        ``none`` (tools are rendered all the same, as vLLM does)."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (OpenAI's dicts), None without any.

        Raises:
            APIError: for a tool_choice without tools, or a named one not among them.
        """
        self._check_tool_choice()
        if not self.tools:
            return None
        return [tool.model_dump(exclude_unset=True) for tool in self.tools]

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if choice is not None and not self.tools:
            raise APIError(400, "tool_choice needs tools: give tools or leave tool_choice "
                           "out.", param="tool_choice")
        known = [tool.function.name for tool in self.tools or []]
        if (isinstance(choice, ChatCompletionNamedToolChoiceParam)
                and choice.function.name not in known):
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, "
                           f"which is not in tools ({', '.join(known)}).", param="tool_choice")


class RolloutRequest(BaseModel):
    """``POST /v1/rollouts``: ``LLM.generate``'s arguments as JSON.

    ``prompts`` is one prompt (text or token ids) or a list; ``sampling_params`` holds
    ``SamplingParams`` fields, one object for all prompts or one each.
    """

    prompts: OnePrompt | Annotated[list[OnePrompt], Field(min_length=1)]
    sampling_params: dict[str, Any] | Annotated[list[dict[str, Any]], Field(min_length=1)] | \
        None = None
    timeout: float | None = TIMEOUT

    def prompt_list(self) -> list[Prompt]:
        """The prompts as a list (ValueError when there are none)."""
        return as_prompt_list(self.prompts)

    def sampling_params_per_prompt(self, num_prompts: int) -> list[SamplingParams]:
        """One ``SamplingParams`` per prompt (the default when none are given).

        Raises:
            APIError: for a field ``SamplingParams`` does not have.
            ValueError: for a value it refuses, or a list of the wrong length.
        """
        return params_per_prompt(_sampling_params(self.sampling_params), num_prompts)


def _sampling_params(fields: dict[str, Any] | list[dict[str, Any]] | None
                     ) -> SamplingParams | list[SamplingParams] | None:
    if fields is None:
        return None
    if isinstance(fields, list):
        return [_sampling_params(f) for f in fields]
    try:
        return SamplingParams(**fields)
    except TypeError as exc:
        raise APIError(400, f"sampling_params: {exc}", param="sampling_params") from exc


class InitInfo(BaseModel):
    """vLLM's ``init_info``: the trainer's store (rank 0) and this engine's rank."""

    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int = 2


class InitWeightTransferRequest(BaseModel):
    """``POST /init_weight_transfer_engine``."""

    init_info: InitInfo


class StartWeightUpdateRequest(BaseModel):
    """``POST /start_weight_update`` (vLLM's field; only checkpoint-format names)."""

    is_checkpoint_format: bool = True


class UpdateInfo(BaseModel):
    """vLLM's ``update_info``: the names, dtypes and shapes the trainer is about to send."""

    names: list[str] | None = None
    dtype_names: list[str] | None = None
    shapes: list[list[int]] | None = None

    def expected(self) -> list[tuple[str, str, tuple[int, ...]]] | None:
        """``(name, dtype, shape)`` per tensor, or None when nothing was announced.

        Raises:
            APIError: when the three lists are partly given or differ in length.
        """
        fields = (self.names, self.dtype_names, self.shapes)
        if all(f is None for f in fields):
            return None
        if any(f is None for f in fields) or len({len(f) for f in fields}) != 1:
            raise APIError(400, "update_info needs names, dtype_names and shapes of the same "
                           "length (or none of them).", param="update_info")
        return [(n, d, tuple(s)) for n, d, s in zip(*fields)]


class UpdateWeightsRequest(BaseModel):
    """``POST /update_weights``."""

    update_info: UpdateInfo = UpdateInfo()


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: vLLM's ``TokenizeCompletionRequest`` (a ``prompt``) or
    ``TokenizeChatRequest`` (``messages``, with the chat completion's template options), as
    one body; ``is_chat`` refuses both or neither."""

    model_config = ConfigDict(strict=True)

    model: str | None = None
    prompt: str | None = Field(default=None, description=(
        "a text, tokenized as a completion of it is; give this or messages."))
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        default=None, description="a chat, tokenized as a chat completion of it is.")
    add_special_tokens: bool | None = Field(default=None, description=(
        "add the tokenizer's special tokens (such as BOS); by default true for a prompt, "
        "false for messages (the chat template writes them), as vLLM's."))
    add_generation_prompt: bool = True
    continue_final_message: bool = CONTINUE_FINAL_MESSAGE
    chat_template_kwargs: dict[str, Any] | None = CHAT_TEMPLATE_KWARGS
    tools: list[ChatCompletionToolsParam] | None = None
    return_token_strs: bool = Field(default=False, description=(
        "also answer each id's token string (token_strs)."))

    @model_validator(mode="after")
    def _default_special_tokens(self) -> TokenizeRequest:
        if self.add_special_tokens is None:
            self.add_special_tokens = self.messages is None
        return self

    def is_chat(self) -> bool:
        """True for ``messages``, False for a ``prompt``.

        Raises:
            APIError: for both, or neither.
        """
        if self.prompt is not None and self.messages is not None:
            raise APIError(400, "give either prompt (a text) or messages (a chat), not both.",
                           param="messages")
        if self.prompt is None and self.messages is None:
            raise APIError(400, "give prompt (a text) or messages (a chat) to tokenize.",
                           param="prompt")
        return self.messages is not None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template reads them (``ChatCompletionRequest``'s)."""
        return [templated(message) for message in self.messages or []]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (OpenAI's dicts), None without any."""
        return [tool.model_dump(exclude_unset=True) for tool in self.tools or []] or None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(strict=True)

    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]
