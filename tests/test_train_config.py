"""Recipe YAML and command-line overrides into TrainConfig."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.trainers.config import load_config

RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe):
    config = load_config(recipe)
    assert config.steps >= 1


def test_overrides_replace_recipe_fields_with_yaml_values(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("steps: 3\noptim: {lr: 1e-5}\nrollout: {num_generations: 4}\n")
    config = load_config(recipe, ["steps=7", "lora.enabled=true", "optim.betas=[0.9, 0.95]",
                                  "rollout.engine={num_kv_blocks: 64, kv_cache_dtype: fp8}",
                                  "rewards=[correct]"])
    assert config.steps == 7 and config.lora.enabled
    assert config.optim.lr == 1e-5 and isinstance(config.optim.lr, float)
    assert config.optim.betas == (0.9, 0.95)
    assert config.rollout.num_generations == 4
    assert config.rollout.engine == {"num_kv_blocks": 64, "kv_cache_dtype": "fp8"}
    assert [r.name for r in config.rewards] == ["correct"]


@pytest.mark.parametrize("overrides, message", [
    (["stpes=3"], r"unknown field\(s\) stpes \(did you mean steps\?\): valid fields are algorithm, "
     r"model"),
    (["optim.learning_rate=1"], r"optim.learning_rate.*valid fields are optim.lr"),
    (["algorithm=dpo"], "algorithm='dpo' is invalid: use one of grpo, ppo"),
    (["rollout.num_generations=1"], "num_generations must be >= 2 for GRPO"),
    (["steps=0"], "steps=0 is invalid"),
    (["optim.lr=fast"], "optim.lr='fast' is invalid: it must be a number"),
    (["steps"], "malformed"),
    (["rollout.engine={kv_blocks: 8}"],
     r"rollout.engine.kv_blocks \(did you mean rollout.engine.num_kv_blocks\?\): valid "
     r"options are dtype"),
    (["rollout.engine={kv_cache_dtype: int8}"],
     "kv_cache_dtype='int8' is invalid: use one of 'auto', 'fp8', 'fp8_e4m3'"),
])
def test_bad_fields_are_refused_naming_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)
