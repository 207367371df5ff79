"""The ``tandem`` command line."""

from __future__ import annotations

from tandem.rollout.cli import main


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
