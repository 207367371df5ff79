"""Structured outputs: decoding constrained to a JSON schema, a regex, a choice list, an EBNF
grammar or a structural tag, with xgrammar (the backend of vLLM and SGLang).

A request's ``StructuredOutputsParams`` is compiled once per distinct spec against the
model's tokenizer (``GrammarCache``) before the request is queued, so a bad spec is a
``ValueError`` that queues nothing. Each sequence, each member of a group included, gets its
own matcher. Every step the sampler masks each constrained row's logits to the tokens its
matcher allows, before penalties, temperature and truncation (so the processed log-probs
are those of the constrained distribution); the scheduler then advances the matcher on the
sampled token. A preempted sequence keeps its tokens and so its matcher. ``grammar_bitmasks``
replays a matcher over finished completions, for a trainer to rebuild the same masks.

xgrammar is imported only when a request asks for structured outputs.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .core.sequence import Sequence

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: .*? is false: )?")
INSTALL_HINT = "pip install 'tandem-rollout[structured]' (xgrammar)"


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """What a completion must match (vLLM's ``StructuredOutputsParams``): exactly one of
    ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (one of these
    strings), ``grammar`` (EBNF, xgrammar's dialect of GBNF), ``json_object`` (any JSON
    object) or ``structural_tag`` (xgrammar's structural tag, as JSON text or a dict).
    ``disable_any_whitespace`` makes JSON compact (no free whitespace between tokens).

    Raises:
        ValueError: when none or several are given, or one has the wrong type.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) or 'none'}.")
        kind, value = given[0], getattr(self, given[0])
        types = {"json": (str, dict), "regex": str, "choice": list, "grammar": str,
                 "json_object": bool, "structural_tag": (str, dict)}[kind]
        if not isinstance(value, types) or (kind == "choice" and not (
                value and all(isinstance(c, str) for c in value))):
            raise ValueError(f"structured_outputs.{kind}={value!r} has the wrong type: "
                             "give " + {"choice": "a non-empty list of strings",
                                        "json_object": "true"}.get(kind, "a string or dict"))

    @property
    def kind(self) -> str:
        """Which constraint this is (one of ``KINDS``)."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """A hashable key of the spec: equal specs compile to the same grammar."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace


def as_structured_outputs(value: StructuredOutputsParams | dict | None
                          ) -> StructuredOutputsParams | None:
    """``value`` as ``StructuredOutputsParams`` (a dict holds its fields).

    Raises:
        ValueError: for a dict with other fields, or anything else.
    """
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs={value!r:.60} is invalid: give an object with "
                         f"one of {', '.join(KINDS)}.")
    try:
        return StructuredOutputsParams(**value)
    except TypeError as exc:
        raise ValueError(f"structured_outputs={value!r:.80} is invalid: {exc}; its fields "
                         "are those of StructuredOutputsParams.") from exc


@dataclass(slots=True, frozen=True)
class Grammar:
    """A compiled constraint (an xgrammar ``CompiledGrammar``), the spec it came from and
    the vocabulary its masks cover (the model's, padding included)."""

    compiled: Any
    params: StructuredOutputsParams
    vocab_size: int

    def matcher(self) -> Any:
        """A new matcher at the start of the grammar (one per sequence)."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled)


class GrammarCache:
    """Compiles constraints against one tokenizer and vocabulary, once per distinct spec.

    The tokenizer is read by xgrammar at the first constrained request, not at start-up:
    a tokenizer it cannot read refuses those requests and nothing else.
    ``compile_seconds`` and ``tokenizer_seconds`` count the time spent compiling.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary (its LM head's rows, padding included), the
            width of the bitmasks.
        stop_token_ids: the tokens that end a completion; a grammar allows them only once
            it is complete.
        capacity: distinct specs kept compiled (least recently used dropped).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                 stop_token_ids: list[int], capacity: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.capacity = capacity
        self.compile_seconds = 0.0
        self.tokenizer_seconds = 0.0
        self._compiler: Any = None
        self._grammars: OrderedDict[tuple, Grammar] = OrderedDict()

    def get(self, params: StructuredOutputsParams) -> Grammar:
        """The compiled grammar of ``params`` (compiled now if new).

        Raises:
            ValueError: naming the spec when xgrammar refuses it, when xgrammar is not
                installed, or when it cannot read the model's tokenizer.
        """
        key = params.key()
        if key in self._grammars:
            self._grammars.move_to_end(key)
            return self._grammars[key]
        compiler = self._compiler or self._new_compiler()
        start = time.perf_counter()
        try:
            compiled = _compile(compiler, params)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"structured_outputs.{params.kind} is invalid: "
                             f"{_reason(exc)}") from exc
        finally:
            self.compile_seconds += time.perf_counter() - start
        self._grammars[key] = grammar = Grammar(compiled, params, self.vocab_size)
        if len(self._grammars) > self.capacity:
            self._grammars.popitem(last=False)
        return grammar

    def _new_compiler(self) -> Any:
        try:
            import xgrammar
        except ImportError as exc:
            raise ValueError(f"structured outputs need xgrammar: {INSTALL_HINT}.") from exc
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer: load the "
                             "engine with a tokenizer (skip_tokenizer_init=False).")
        start = time.perf_counter()
        try:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        except Exception as exc:  # xgrammar raises many kinds on a tokenizer it cannot read
            raise ValueError(f"structured outputs are not available for this model: xgrammar "
                             f"cannot read its tokenizer ({type(exc).__name__}: {exc}).") from exc
        finally:
            self.tokenizer_seconds += time.perf_counter() - start
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler


def _compile(compiler: Any, params: StructuredOutputsParams) -> Any:
    """xgrammar's compiled grammar of ``params``."""
    any_whitespace = not params.disable_any_whitespace
    kind, value = params.kind, getattr(params, params.kind)
    if kind == "json":
        return compiler.compile_json_schema(value, any_whitespace=any_whitespace)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(value))
    if kind == "grammar":
        return compiler.compile_grammar(value)
    import xgrammar

    tag = value if isinstance(value, str) else json.dumps(value)
    return compiler.compile_structural_tag(xgrammar.StructuralTag.from_json(tag))


def _reason(exc: Exception) -> str:
    """xgrammar's message without its time stamp, C++ source line and check text."""
    return XGRAMMAR_PREFIX.sub("", str(exc)).strip()


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose strings are exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Set to -inf, in place, each constrained row's tokens its matcher does not allow next
    (rows whose sequence has no matcher are left alone)."""
    rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
    if not rows:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(seqs), logits.shape[1])
    for row in rows:
        seqs[row].matcher.fill_next_token_bitmask(bitmask, row)
    if logits.is_cuda:  # pinned, so the copy queues without waiting (worker's to_device)
        bitmask = bitmask.pin_memory()
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                         indices=rows)


def grammar_bitmasks(grammar: Grammar, completions: list[list[int]], width: int) -> torch.Tensor:
    """``[len(completions), width, ceil(V / 32)]`` int32: per completion token the
    packed mask its matcher allowed when it was sampled (all allowed past each completion).

    Raises:
        ValueError: for a completion the grammar does not accept (not sampled under it).
    """
    masks = torch.full((len(completions), width, (grammar.vocab_size + 31) // 32), -1,
                       dtype=torch.int32)
    for row, tokens in enumerate(completions):
        matcher = grammar.matcher()
        for slot, token in enumerate(tokens):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(masks[row], slot)
            if not matcher.accept_token(token):
                raise ValueError(f"completion {row} token {slot} ({token}) does not follow "
                                 f"its structured_outputs.{grammar.params.kind}: it was not "
                                 "sampled under that constraint.")
    return masks


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool ``[..., vocab_size]`` of a packed int32 ``[..., ceil(vocab_size / 32)]``
    mask (bit ``j % 32`` of word ``j // 32`` is token ``j``)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()
