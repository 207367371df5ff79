"""Task rewards take completions as text or as TRL's generated messages."""

from __future__ import annotations

from tandem.trainers.tasks import correct_reward, hash_format_reward, short_answer_reward


def test_rewards_score_text_and_conversational_completions_alike():
    texts = ["12", "It is 12.", "#### 7"]
    messages = [[{"role": "assistant", "content": text}] for text in texts]
    for completions in (texts, messages):
        assert correct_reward(completions, answer=[12, 12, 8]) == [1.0, 1.0, 0.0]
        assert short_answer_reward(completions) == [1.0, 1.0, 1.0]
        assert hash_format_reward(completions) == [0.0, 0.0, 1.0]
