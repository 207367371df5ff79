"""GRPO and PPO trainers colocated with the engine (they come with the trainers issue)."""
