"""Multi-turn episodes: environments and tools, token-in/token-out trajectories checked
against a fresh engine prefilling each turn's whole context, no per-turn barrier, and bad
input turned into observations or clear errors without leaking a block."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from tandem.rollout import LLM, SamplingParams
from tandem.trainers.environments import EnvStep, ToolEnvironment
from tandem.trainers.episodes import ConversationTokenizer, EpisodeRunner


class Scripted:
    """Answers every turn with a tool message; done after ``turns`` answers."""

    def __init__(self, turns: int, delay: float = 0.0) -> None:
        self.turns, self.delay, self.answers = turns, delay, 0

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, messages):
        time.sleep(self.delay)
        self.answers += 1
        return EnvStep([{"role": "tool", "content": f"result {self.answers}"}],
                       reward=float(self.answers), done=self.answers >= self.turns)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def turn_params(tokenizer, **kwargs) -> SamplingParams:
    """Greedy turns that end at any even token id (the random model ends turns soon)."""
    stops = [t for t in range(len(tokenizer)) if t % 2 == 0]
    return SamplingParams(temperature=0, max_tokens=6, stop_token_ids=stops, logprobs=0,
                          skip_special_tokens=False, **kwargs)


def test_trajectories_equal_a_fresh_engine_prefilling_each_turn(llama_dir, tokenizer):
    llm = LLM(str(llama_dir))
    params = turn_params(tokenizer)
    runner = EpisodeRunner(llm.engine, tokenizer, params, max_turns=4)
    examples = [{"prompt": "What is 2+3?"}, {"prompt": "The quick brown fox"}]
    groups = runner.run(examples, lambda example: Scripted(turns=3))
    reference = LLM(str(llama_dir), enable_prefix_caching=False)
    conversations = ConversationTokenizer(tokenizer)
    assert max(g[0].num_turns for g in groups) >= 2
    for (trajectory,) in groups:
        mask, ids = trajectory.loss_mask, trajectory.token_ids
        assert len(mask) == len(ids) and sum(mask) == len(trajectory.logprobs)
        starts = [i for i in range(1, len(ids)) if mask[i] and not mask[i - 1]]
        assert len(starts) == trajectory.num_turns
        for start in starts:
            end = next((i for i in range(start, len(ids)) if not mask[i]), len(ids))
            expected = reference.generate([ids[:start]], params, use_tqdm=False)[0].outputs[0]
            assert ids[start:end] == expected.token_ids
            offset = sum(mask[:start])
            assert trajectory.logprobs[offset:offset + end - start] == pytest.approx(
                expected.logprobs, abs=1e-5)
        rendered = conversations.render(trajectory.messages)
        assert rendered.startswith(tokenizer.decode(ids, skip_special_tokens=False))
        assert trajectory.finish_reason in ("done", "max_turns", "length")
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["held_sequences"] == 0


def test_an_episode_whose_tool_answered_does_not_wait_for_a_slow_one(llama_dir, tokenizer):
    llm = LLM(str(llama_dir))
    runner = EpisodeRunner(llm.engine, tokenizer, turn_params(tokenizer), max_turns=3)
    delays = iter([1.0, 0.0])
    runner.run([{"prompt": "slow"}, {"prompt": "fast one"}],
               lambda example: Scripted(turns=2, delay=next(delays)))
    events = runner.events
    slow_answer = events.index(("observation", 0))
    fast_turns = [i for i, event in enumerate(events) if event == ("turn", 1)]
    assert len(fast_turns) >= 2 and fast_turns[1] < slow_answer


def test_group_members_become_their_own_episodes(llama_dir, tokenizer):
    llm = LLM(str(llama_dir))
    params = SamplingParams(n=3, max_tokens=4, seed=0, stop_token_ids=[5], temperature=1.0)
    groups = EpisodeRunner(llm.engine, tokenizer, params, max_turns=2).run(
        [{"prompt": "What is 2+3?"}], lambda example: Scripted(turns=2))
    assert len(groups[0]) == 3
    assert len({tuple(t.token_ids[:t.num_prompt_tokens]) for t in groups[0]}) == 1
    assert llm.stats()["kv_blocks_used"] == 0


def test_episodes_truncate_at_their_token_limit(llama_dir, tokenizer):
    llm = LLM(str(llama_dir))
    runner = EpisodeRunner(llm.engine, tokenizer, turn_params(tokenizer), max_turns=50,
                           max_total_tokens=40)
    (trajectory,), = runner.run([{"prompt": "What is 2+3?"}],
                                lambda example: Scripted(turns=100))
    assert trajectory.finish_reason in ("max_total_tokens", "length")
    assert len(trajectory.token_ids) < 40 + 6
    assert llm.stats()["kv_blocks_used"] == 0


def test_an_environment_returning_a_non_message_is_named_and_leaks_nothing(llama_dir,
                                                                           tokenizer):
    class Broken(Scripted):
        def step(self, messages):
            return EnvStep(["not a message"])

    llm = LLM(str(llama_dir))
    runner = EpisodeRunner(llm.engine, tokenizer, turn_params(tokenizer))
    with pytest.raises(ValueError, match="Broken.step returned 'not a message'"):
        runner.run([{"prompt": "a"}, {"prompt": "b"}], lambda example: Broken(turns=2))
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["held_sequences"] == 0
    assert not llm.engine.has_unfinished_requests()


def test_a_template_that_rewrites_earlier_messages_is_refused(tokenizer):
    forgetful = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    forgetful.chat_template = ("{% for m in messages[-2:] %}{{ m['role'] }}: {{ m['content'] }}\n"
                               "{% endfor %}")
    with pytest.raises(ValueError, match="does not preserve prefixes"):
        ConversationTokenizer(forgetful)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def fails(x: int) -> int:
    """Always fails.

    Args:
        x: ignored.
    """
    raise RuntimeError("broken on purpose")


def sleeps(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "awake"


@pytest.mark.parametrize(("call", "expected"), [
    ('{"name": "add", "arguments": {"a": 2, "b": 3}}', "5"),
    ('{"name": "add", "arguments": {"a": 2', "error: the tool call is not JSON"),
    ('{"name": "mul", "arguments": {}}', "error: unknown tool 'mul'"),
    ('{"name": "add", "arguments": {"a": 2}}', "error: wrong arguments for add"),
    ('{"name": "fails", "arguments": {"x": 1}}', "error: fails raised RuntimeError"),
    ('{"name": "sleeps", "arguments": {"seconds": 5}}', "error: sleeps ran past"),
])
def test_tool_calls_and_their_failures_become_observations(call, expected):
    environment = ToolEnvironment([add, fails, sleeps], timeout=0.2)
    assert [s["function"]["name"] for s in environment.schemas] == ["add", "fails", "sleeps"]
    step = environment.step([{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"}])
    assert not step.done and step.messages[0]["role"] == "tool"
    assert step.messages[0]["content"].startswith(expected)
    assert step.metrics["tool_calls"] == 1
    assert step.metrics["tool_errors"] == float(expected.startswith("error"))


def test_a_turn_without_a_tool_call_ends_the_episode():
    environment = ToolEnvironment([add], system_prompt="Use <tool_call>.")
    messages = environment.reset({"prompt": "What is 2+3?"})
    assert [m["role"] for m in messages] == ["system", "user"]
    assert environment.step(messages + [{"role": "assistant", "content": "5"}]).done
