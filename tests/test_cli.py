"""The ``tandem`` command line."""

from __future__ import annotations

import dataclasses

import yaml

from tandem.cli import build_parser, main
from tandem.cli.serve import engine_config
from tandem.rollout.config import EngineConfig
from tandem.trainers.config import TrainConfig, load_config, to_dict


def test_generate_prints_n_completions_per_prompt(llama_dir, capsys):
    status = main(["generate", "--model", str(llama_dir), "--prompt", "What is 2+3?",
                   "--prompt", "Seven", "-n", "2", "--max-tokens", "4", "--seed", "1"])
    printed = capsys.readouterr().out.splitlines()
    assert status == 0
    assert sum(line.startswith("['What is 2+3?' #") for line in printed) == 2
    assert sum(line.startswith("['Seven' #") for line in printed) == 2
    assert "tok/s" in printed[-1]


def test_bad_input_exits_with_a_clear_message(llama_dir, capsys):
    status = main(["generate", "--model", str(llama_dir), "--prompt", "x", "--top-p", "0"])
    assert status == 2
    assert "SamplingParams.top_p=0.0 is invalid" in capsys.readouterr().err


def test_train_runs_a_recipe_from_overrides_and_says_where_it_went(llama_dir, tmp_path,
                                                                   capsys):
    status = main(["train", f"model={llama_dir}", "task=target_token",
                   "task_args={token_id: 100}", "steps=1", "eval_size=2",
                   f"output_dir={tmp_path}", "rollout.prompts_per_step=2",
                   "rollout.num_generations=2", "rollout.max_tokens=4",
                   "rollout.engine={num_kv_blocks: 32, max_model_len: 64}",
                   "logging.wandb=false", "logging.progress_bar=false"])
    printed = capsys.readouterr().out
    assert status == 0
    assert "held-out accuracy: before" in printed
    assert f"checkpoint: {tmp_path / 'checkpoint-1'}" in printed
    assert (tmp_path / "checkpoint-1" / "model.safetensors").is_file()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_train_refuses_an_unknown_field_naming_the_nearest(capsys):
    assert main(["train", "stepz=1"]) == 2
    assert "unknown field(s) stepz (did you mean steps?)" in capsys.readouterr().err
    assert main(["train", "rollout.temprature=0.5", "rollout.engine.max_num_seq=4"]) == 2
    assert "(did you mean rollout.temperature?)" in capsys.readouterr().err
    assert main(["train", "rollout.engine.max_num_seq=4"]) == 2
    assert "(did you mean rollout.engine.max_num_seqs?)" in capsys.readouterr().err
    assert main(["train", "qqqqqq=1"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_train_lists_every_recipe_key_with_its_help(capsys):
    assert main(["train", "--list-keys"]) == 0
    listed = capsys.readouterr().out
    leaves = _leaf_keys(to_dict(TrainConfig()))
    engine = [f"rollout.engine.{f.name}" for f in dataclasses.fields(EngineConfig)
              if f.name != "model"]
    for key in [*leaves, *engine]:  # every key, each followed by its help
        lines = listed.splitlines()
        line = next(i for i, text in enumerate(lines) if text.startswith(key + " ("))
        assert lines[line + 1].startswith("    ") and len(lines[line + 1].strip()) > 4
    assert "rollout.temperature (float, default: 1.0)" in listed


def test_print_config_gives_the_resolved_recipe_that_loads_back_the_same(tmp_path, capsys):
    assert main(["train", "recipes/grpo_arith.yaml", "steps=3", "--print-config"]) == 0
    printed = capsys.readouterr().out
    resolved = load_config("recipes/grpo_arith.yaml", ["steps=3"])
    data = yaml.safe_load(printed)
    assert data["steps"] == 3 and data["rollout"]["engine"] == resolved.rollout.engine
    assert set(data) == set(to_dict(resolved))  # every section, defaults included
    (tmp_path / "resolved.yaml").write_text(printed)
    assert load_config(tmp_path / "resolved.yaml") == resolved


def _leaf_keys(data: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in data.items():
        if isinstance(value, dict) and name not in ("engine", "task_args", "structured_outputs"):
            keys += _leaf_keys(value, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def test_serve_chunks_prefill_by_1024_tokens_on_cpu_unless_told():
    parser = build_parser()
    default = engine_config(parser.parse_args(["serve", "m", "--device", "cpu"]))
    assert default.max_num_batched_tokens == 1024
    assert EngineConfig(model="m", device="cpu").max_num_batched_tokens == 4096
    told = parser.parse_args(["serve", "m", "--device", "cpu", "--max-num-batched-tokens", "512"])
    assert engine_config(told).max_num_batched_tokens == 512


def test_generate_and_serve_take_the_kv_cache_dtype(llama_dir, capsys):
    parser = build_parser()
    served = engine_config(parser.parse_args(["serve", "m", "--kv-cache-dtype", "fp8"]))
    assert served.kv_cache_dtype == "fp8"
    assert engine_config(parser.parse_args(["serve", "m"])).kv_cache_dtype == "auto"
    status = main(["generate", "--model", str(llama_dir), "--prompt", "What is 2+3?",
                   "--max-tokens", "4", "--kv-cache-dtype", "fp8"])
    assert status == 0 and "tok/s" in capsys.readouterr().out
    assert main(["generate", "--model", str(llama_dir), "--prompt", "x",
                 "--kv-cache-dtype", "fp16"]) == 2
    assert "kv_cache_dtype='fp16' is invalid: use one of 'auto', 'fp8'" in \
        capsys.readouterr().err
