"""The Python client: LLM.generate's shapes over HTTP, and weight updates over gloo from a
separate trainer process while other clients generate."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tandem.rollout import LLM, SamplingParams, WeightUpdateError
from tandem.rollout.serving.client import ServerError, TandemClient
from tests.test_server import API_KEY, CONTROL_KEY, ENGINE_OPTIONS, running_server
from tests.test_sync_distributed import BUCKET_BYTES, answer
from tests.test_weight_update import GREEDY, PROMPTS, fresh_completions, trainer_model

SAMPLED = SamplingParams(n=4, max_tokens=24, seed=1, ignore_eos=True, logprobs=0)


def trainer_process(url: str, folder: str, conn: Connection) -> None:
    """A trainer in its own process: joins the server's weight transfer, then on each
    command pushes its weights (seeded noise on the checkpoint) and answers the version or
    the refusal."""
    torch.set_num_threads(1)
    client = TandemClient(url, api_key=API_KEY, control_api_key=CONTROL_KEY)
    client.init_weight_transfer(bucket_bytes=BUCKET_BYTES, timeout=timedelta(seconds=60))
    conn.send("joined")
    state = trainer_model(Path(folder), seed=1).state_dict()
    for command in iter(conn.recv, "stop"):
        tensors = dict(state)
        if command == "nan":
            name = "model.layers.1.mlp.down_proj.weight"
            tensors[name] = torch.full_like(state[name], float("nan"))
        try:
            conn.send(client.update_weights(tensors.items()))
        except WeightUpdateError as exc:
            conn.send(f"refused: {exc}")


SERVE_EXTRA = ("fastapi", "uvicorn", "pydantic", "starlette")


def test_client_and_server_config_import_without_the_serve_extra():
    blocked = "".join(f"sys.modules[{name!r}] = None\n" for name in SERVE_EXTRA)
    script = ("import sys\n" + blocked + "import tandem.rollout.serving.client\n"
              "import tandem.rollout.serving.config\nimport tandem.rollout.client\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_generate_returns_what_llm_generate_returns(llama_dir):
    expected = LLM(str(llama_dir), **ENGINE_OPTIONS).generate(
        [PROMPTS[0], "What is 2+3?"], [GREEDY, SAMPLED], use_tqdm=False)
    with running_server(llama_dir) as (url, _):
        client = TandemClient(url, api_key=API_KEY)
        outputs = client.generate([PROMPTS[0], "What is 2+3?"], [GREEDY, SAMPLED])
        with pytest.raises(ServerError, match="HTTP 400: n=100 exceeds"):
            client.generate("x", SamplingParams(n=100))
    for got, want in zip(outputs, expected):
        assert (got.prompt, got.prompt_token_ids) == (want.prompt, want.prompt_token_ids)
        for a, b in zip(got.outputs, want.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text,
                                                              b.finish_reason)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            assert a.weight_versions == (0, 0)


@contextmanager
def joined_trainer(url: str, folder) -> Iterator[Connection]:
    """A ``trainer_process`` that has joined the server's weight transfer: its pipe (sent
    "stop" and joined on exit)."""
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    trainer = context.Process(target=trainer_process, args=(url, str(folder), child_conn),
                              daemon=True)
    trainer.start()
    try:
        assert answer(conn) == "joined"
        yield conn
        conn.send("stop")
    finally:
        trainer.join(30)
        trainer.kill()


def test_weight_update_from_trainer_process_while_clients_generate(llama_dir, tmp_path):
    with running_server(llama_dir, enable_weight_transfer=True,
                        control_api_key=CONTROL_KEY) as (url, engine):
        client = TandemClient(url, api_key=API_KEY)
        with joined_trainer(url, llama_dir) as conn:
            versions, stop = [], threading.Event()
            generating = threading.Thread(target=lambda: generate_until(client, stop, versions))
            generating.start()
            conn.send("update")
            assert answer(conn) == 1
            stop.set()
            generating.join(120)
            after = client.generate(PROMPTS, GREEDY)
            conn.send("nan")
            refusal = answer(conn)
    assert versions and versions == sorted(versions)
    assert all(o.weight_version == 1 and o.outputs[0].weight_versions == (1, 1) for o in after)
    assert [o.outputs[0].token_ids for o in after] == fresh_completions(
        trainer_model(llama_dir, seed=1), llama_dir, tmp_path)
    assert refusal.startswith("refused: ") and "NaN" in refusal
    assert engine.weight_version == 1


def test_weight_update_reaches_an_engine_core_in_its_own_process(llama_dir, tmp_path):
    """``tandem serve``'s default: the receiver runs in the core's process, and a pushed
    update (and a refused one) behaves as with the core on a thread."""
    from tests.test_server_engine_core import running_process_server

    with running_process_server(llama_dir, enable_weight_transfer=True) as (url, _):
        client = TandemClient(url, api_key=API_KEY)
        with joined_trainer(url, llama_dir) as conn:
            conn.send("update")
            assert answer(conn) == 1
            after = client.generate(PROMPTS, GREEDY)
            conn.send("nan")
            refusal = answer(conn)
            still = client.generate(PROMPTS, GREEDY)
    expected = fresh_completions(trainer_model(llama_dir, seed=1), llama_dir, tmp_path)
    assert [o.outputs[0].token_ids for o in after] == expected
    assert all(o.weight_version == 1 for o in after)
    assert refusal.startswith("refused: ") and "NaN" in refusal
    assert [o.outputs[0].token_ids for o in still] == expected  # the refused one left none


def generate_until(client: TandemClient, stop: threading.Event, versions: list) -> None:
    """Sample groups until ``stop``; record each completion's weight versions."""
    while not stop.is_set():
        for output in client.generate(PROMPTS, SAMPLED):
            versions += [c.weight_versions for c in output.outputs]
