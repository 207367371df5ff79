"""TRL's GRPOTrainer tool loop (``tools=``) with Tandem generating: the tool really runs, its
result is masked out of the loss, and every turn reaches the engine as TRL's own ids.

One module-scoped run of two steps records what crosses each seam (TRL -> the generation
object, the generation object -> the engine, TRL's tool loop, TRL's loss inputs, the reward);
the tests read that record.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from transformers.utils import get_json_schema  # noqa: E402

from tandem.trainers.trl_integration import TandemConfig, tandem_grpo_trainer  # noqa: E402

from .conftest import CountingTokenizer, count_tokenizations  # noqa: E402
from .test_trl_integration import grpo_config  # noqa: E402
from .tool_model import CALL_TEXT, QUESTION, conversation, multiply  # noqa: E402

# The prompt is about 720 tokens (the tool's schema in byte-level tokens); a group of four
# shares it, and each completion is the call (76 tokens), the tool turn and the answer.
TOOL_TANDEM = TandemConfig(engine={"num_kv_blocks": 128})
MAX_STEPS = 2
TOOL_SCHEMAS = [get_json_schema(multiply)]
# At temperature 0.9 the fitted model writes the call exactly in 19 samples of 20 and the
# answer in all, and no sampled call fails (0 of 200): calls happen whatever the device, yet
# the sampled tokens keep log-probs far enough from 0 for a mismatch to show.
TOOL_SETTINGS = dict(gradient_accumulation_steps=1, max_steps=MAX_STEPS, temperature=0.9,
                     max_completion_length=160, vllm_max_model_length=1024,
                     max_tool_calling_iterations=2, learning_rate=1e-3)


@dataclass
class ToolRun:
    """What crossed each seam during the run, in call order: each spied call is kept as
    (what it was given, what it returned), the latter None where not kept.

    Attributes:
        trainer: the trained ``GRPOTrainer``.
        turns: ``TandemGeneration.generate`` calls: (TRL's prompt ids, the 4-tuple returned).
        engine_calls: engine ``LLM.generate`` calls: ((prompt ids, each request's ``n``), None).
        tool_loops: ``_tool_call_loop`` calls: ((prompts, prompt_ids, completion_ids,
            completions) on entry, None).
        suffixes: ``_get_tool_suffix_ids`` calls: (None, the tool turn's ids).
        loss_batches: ``_compute_loss`` calls: (its completion ids and masks, None).
        conversations: per reward call, the completions (message lists) it scored.
        tokenizations: the engine's tokenizer, counting its calls.
    """

    trainer: Any
    turns: list = field(default_factory=list)
    engine_calls: list = field(default_factory=list)
    tool_loops: list = field(default_factory=list)
    suffixes: list = field(default_factory=list)
    loss_batches: list = field(default_factory=list)
    conversations: list = field(default_factory=list)
    tokenizations: CountingTokenizer | None = None

    @property
    def logs(self) -> list[dict]:
        """TRL's per-step logs."""
        return [log for log in self.trainer.state.log_history if "tools/call_frequency" in log]


def answered_reward(seen: list) -> Callable[..., list[float]]:
    """A reward of TRL's conversational signature: 1.0 when the conversation's last message
    is the assistant giving the product, 12; each call's completions are kept in ``seen``."""

    def answered(completions: list[list[dict]], **_) -> list[float]:
        seen.append(copy.deepcopy(completions))
        return [float(c[-1]["role"] == "assistant" and "12" in c[-1]["content"])
                for c in completions]

    return answered


def spread_reward(completions: list, **_) -> list[float]:
    """Differs within every group whatever was sampled, so the weights move every step."""
    return [index / len(completions) for index in range(len(completions))]


def spy(patch: pytest.MonkeyPatch, owner: Any, name: str, calls: list,
        keep: Callable[[tuple, dict], Any], keep_result: bool = True) -> None:
    """Wrap ``owner.name`` to append (a copy of ``keep(args, kwargs)`` taken before the call,
    a copy of its result or None) to ``calls``."""
    original = getattr(owner, name)

    def spied(*args: Any, **kwargs: Any) -> Any:
        kept = copy.deepcopy(keep(args, kwargs))
        result = original(*args, **kwargs)
        calls.append((kept, copy.deepcopy(result) if keep_result else None))
        return result

    patch.setattr(owner, name, spied)


def install_spies(run: ToolRun, patch: pytest.MonkeyPatch) -> None:
    """Record each seam of ``run.trainer`` into ``run``."""
    trainer, generation = run.trainer, run.trainer.vllm_generation
    spy(patch, generation, "generate", run.turns, lambda args, kwargs: kwargs["prompts"])
    spy(patch, generation.llm, "generate", run.engine_calls,
        lambda args, kwargs: (args[0], [params.n for params in args[1]]), keep_result=False)
    spy(patch, trainer, "_tool_call_loop", run.tool_loops, lambda args, kwargs: args[:4],
        keep_result=False)
    spy(patch, trainer, "_get_tool_suffix_ids", run.suffixes, lambda args, kwargs: None)
    spy(patch, trainer, "_compute_loss", run.loss_batches,
        lambda args, kwargs: {key: args[1][key].cpu()
                              for key in ("completion_ids", "completion_mask", "tool_mask")},
        keep_result=False)
    run.tokenizations = count_tokenizations(generation.llm.engine, patch)


@pytest.fixture(scope="module")
def tool_run(tool_model_dir, tmp_path_factory) -> ToolRun:
    """Two GRPO steps of ``QUESTION`` with ``tools=[multiply]``, Tandem generating."""
    conversations: list = []
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": QUESTION}]}] * 4)
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    args = grpo_config(tmp_path_factory.mktemp("trl_tools"), **TOOL_SETTINGS)
    trainer = tandem_grpo_trainer(
        model=str(tool_model_dir), reward_funcs=[answered_reward(conversations), spread_reward],
        args=args, train_dataset=dataset, processing_class=tokenizer, tools=[multiply],
        tandem=TOOL_TANDEM)
    run = ToolRun(trainer, conversations=conversations)
    with pytest.MonkeyPatch.context() as patch:
        install_spies(run, patch)
        trainer.train()
    return run


def rendered_tool_turn(tokenizer: Any) -> str:
    """The chat template's text between the model's call (ended by ``<|im_end|>``) and its
    answer, rendered from the fitted conversation: the tool turn TRL appends."""
    text = tokenizer.apply_chat_template(conversation()[:3], tools=TOOL_SCHEMAS,
                                         tokenize=False, add_generation_prompt=True)
    _, call, after = text.partition(CALL_TEXT + "<|im_end|>")
    assert call and "<tool_response>\n12\n</tool_response>" in after
    return after


def expanded(engine_call: tuple) -> list[list[int]]:
    """An engine call's prompts, one per completion (a request of ``n`` counts ``n`` times)."""
    (prompts, counts), _ = engine_call
    return [list(prompt) for prompt, count in zip(prompts, counts) for _ in range(count)]


def calling_rows(completions: list[list[dict]]) -> list[int]:
    """The episodes whose first turn TRL parsed into tool calls."""
    return [index for index, messages in enumerate(completions) if messages[0].get("tool_calls")]


def test_grpo_tool_loop_calls_the_tool_and_stays_on_policy(tool_run):
    logs, tokenizer = tool_run.logs, tool_run.trainer.processing_class
    assert len(logs) == MAX_STEPS
    assert all(log["tools/failure_frequency"] == 0 for log in logs)
    assert all(log["sampling/sampling_logp_difference/max"] < 1e-3 for log in logs)
    # The second round samples from weights the first step changed and Tandem was sent.
    assert logs[0]["grad_norm"] > 1e-3 and tool_run.trainer.vllm_generation.llm.weight_version == 2
    # The reward saw whole conversations: the call, the tool's result, the answer.
    for log, conversations in zip(logs, tool_run.conversations, strict=True):
        called = [messages for messages in conversations if len(messages) > 1]
        assert called and log["tools/call_frequency"] == len(called) / len(conversations)
        assert all([m["role"] for m in messages] == ["assistant", "tool", "assistant"] and
                   messages[1]["content"] == "12" for messages in called)
        assert log["rewards/answered/mean"] > 0
    # Each step: the question, then one tool turn, whose prompts end with the tool's result;
    # after the fitted call, that prompt is the chat template's own rendering of the episode.
    assert len(tool_run.engine_calls) == 2 * MAX_STEPS
    tool_turn = rendered_tool_turn(tokenizer)
    rendered = tokenizer.apply_chat_template(conversation()[:3], tools=TOOL_SCHEMAS,
                                             add_generation_prompt=True, return_dict=False)
    for engine_call in tool_run.engine_calls[1::2]:
        prompts = expanded(engine_call)
        assert all(tokenizer.decode(prompt).endswith(tool_turn) for prompt in prompts)
        assert list(rendered) in prompts


def episodes_by_step(run: ToolRun) -> list[list[tuple[list[int], bool]]]:
    """Per step, each episode's sampled tokens (its first turn's, then its post-tool turn's,
    as Tandem returned them to TRL) and whether it called the tool."""
    steps = []
    for (loop_input, _), first, post_tool in zip(run.tool_loops, run.turns[0::2],
                                                 run.turns[1::2], strict=True):
        post = dict(zip(calling_rows(loop_input[3]), post_tool[1][1], strict=True))
        steps.append([(list(ids) + list(post.get(index, [])), index in post)
                      for index, ids in enumerate(first[1][1])])
    return steps


def loss_rows(batch: dict, tokenizer: Any) -> list[tuple[list[int], str]]:
    """Per row of a loss batch: its tokens in the loss, and the text of its tokens TRL's
    ``tool_mask`` leaves out (checked to be one run)."""
    rows = []
    for ids, valid, tool_mask in zip(batch["completion_ids"], batch["completion_mask"].bool(),
                                     batch["tool_mask"], strict=True):
        masked = valid & (tool_mask == 0)
        positions = masked.nonzero().flatten()
        if positions.numel():
            assert torch.equal(positions, torch.arange(positions[0], positions[-1] + 1))
        rows.append((ids[valid & (tool_mask == 1)].tolist(), tokenizer.decode(ids[masked])))
    return rows


def test_tool_result_tokens_are_masked_out_of_the_loss_and_sampled_tokens_are_not(tool_run):
    tokenizer = tool_run.trainer.processing_class
    tool_turn = rendered_tool_turn(tokenizer)
    assert len(tool_run.loss_batches) == MAX_STEPS
    for (batch, _), episodes in zip(tool_run.loss_batches, episodes_by_step(tool_run),
                                    strict=True):
        assert any(called for _, called in episodes)
        expected = [(tokens, tool_turn if called else "") for tokens, called in episodes]
        assert sorted(loss_rows(batch, tokenizer)) == sorted(expected)


def test_every_tool_turn_reaches_the_engine_as_trls_own_ids(tool_run):
    assert sum(tool_run.tokenizations.calls.values()) == 0
    suffixes = iter(result for _, result in tool_run.suffixes)
    first_turns, tool_turns = tool_run.engine_calls[0::2], tool_run.engine_calls[1::2]
    assert len(tool_run.tool_loops) == len(first_turns) == len(tool_turns) == MAX_STEPS
    for (loop_input, _), first, tool_turn in zip(tool_run.tool_loops, first_turns, tool_turns):
        _, prompt_ids, completion_ids, completions = loop_input
        assert expanded(first) == prompt_ids
        calling = calling_rows(completions)
        assert calling
        assert expanded(tool_turn) == [prompt_ids[i] + completion_ids[i] + next(suffixes)
                                       for i in calling]
    assert next(suffixes, None) is None
