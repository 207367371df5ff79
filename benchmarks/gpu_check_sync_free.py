"""The GPU check's sync-free section (issue 56): the steady-state overlapped decode loop never
waits for the device.

Per configuration (a dense model greedy, the MoE model through the fused Triton experts, an
FP8 KV pool, int8 weights, routing replay, ``min_tokens``, the three penalties, top-p/top-k,
seeded and unseeded sampling, sampled log-probs with the top 5), 8 sequences decode with
overlapped steps (``async_scheduling=True``); after a warm-up of as many steps (compiles,
autotuning and graph replays are behind it), every ``ModelRunner.launch`` of the next steps
runs under ``torch.cuda.set_sync_debug_mode("error")``, so the first synchronizing call in
a launch raises. One row per configuration: ok, or that call's message and the innermost
frame of the project (``tandem/...``) it was made from. With penalties each step lands at
once (the landing reads the tokens on the host), but its launch must still not wait.

Steps that must land at once for their launch to be built (grammars, prompt log-probs) are
left out. On a CPU (``--smoke``) there is no sync debug mode: the loop runs unchecked.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from gpu_check_common import Recorder, collect, make_llm
from gpu_check_throughput import decoding

from tandem import rollout
from tandem.rollout import LLM

BATCH = 8
STEPS = 6  # warmed up, then checked (2 on CPU)


def dense_configs(steps: int) -> dict[str, dict]:
    """The dense model's configurations: ``SamplingParams`` fields over ``decoding``'s greedy
    requests (room for ``3 * steps + 8`` tokens)."""
    return {"dense, greedy": {},
            "min_tokens": dict(min_tokens=3 * steps + 8, ignore_eos=False),  # EOS always masked
            "penalties": dict(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5,
                              frequency_penalty=0.5),
            "top-p/top-k": dict(temperature=1.0, top_p=0.9, top_k=50),
            "seeded": dict(temperature=1.0, seed=7),
            "unseeded": dict(temperature=1.0),
            "log-probs, top 5": dict(temperature=1.0, logprobs=5)}


MOE = {"MoE, fused Triton experts": {}, "routing replay": dict(return_routed_experts=True)}


def check_sync_free(rec: Recorder, folder: Path, moe_folder: Path) -> None:
    """Every configuration's launches under the sync debug mode (see the module docstring)."""
    steps = 2 if rec.smoke else STEPS
    for model, options, configs in ((folder, {}, dense_configs(steps)), (moe_folder, {}, MOE),
                                    (folder, dict(kv_cache_dtype="fp8"), {"FP8 KV": {}}),
                                    (folder, dict(quantization="int8"), {"int8 weights": {}})):
        check_engine(rec, model, options, configs, steps)
        collect()


def check_engine(rec: Recorder, model: Path, options: dict, configs: dict[str, dict],
                 steps: int) -> None:
    """``configs`` one by one on an engine of ``model`` with ``options``; an engine that a
    failed launch left mid-step is replaced before the next configuration."""
    llm = None
    for name, sampling in configs.items():
        if llm is None:
            try:
                llm = make_llm(rec, model, async_scheduling=True, max_num_seqs=16, **options)
            except ValueError as refusal:  # e.g. FP8 below compute capability 8.9
                rec.record("sync_free", name, refused=str(refusal)[:300])
                continue
        if not check_config(rec, llm, name, sampling, steps):
            llm = None
            collect()


def check_config(rec: Recorder, llm: LLM, name: str, sampling: dict, steps: int) -> bool:
    """One configuration's row; False when a launch (or the loop around it) failed."""
    checked = rec.device.type == "cuda"
    launches, errors = [0], []
    try:
        with decoding(llm, BATCH, steps, **sampling) as run:
            run()  # warm-up
            with sync_checked(llm, checked, launches, errors):
                run()
    except Exception as error:  # noqa: BLE001 - the row says what stopped the loop
        failure = errors[0] if errors else innermost_tandem_frame(error)
        rec.record("sync_free", name, launches=launches[0], **failure, ok=False)
        return False
    rec.record("sync_free", name, launches=launches[0],
               graphs=llm.stats()["num_decode_graphs"],
               sync_debug_mode="error" if checked else "none on CPU",
               ok=launches[0] == steps if checked else None)
    return True


@contextmanager
def sync_checked(llm: LLM, checked: bool, launches: list[int],
                 errors: list[dict]) -> Iterator[None]:
    """Wrap the engine's runner's ``launch``: each call counted in ``launches[0]`` and, with
    ``checked``, run under ``set_sync_debug_mode("error")`` (0 again after it); the first
    call that raises is described in ``errors`` (text only: a kept exception would keep the
    engine alive through its traceback)."""
    runner = llm.engine.runner
    launch = runner.launch

    def checked_launch(*args, **kwargs):
        launches[0] += 1
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*args, **kwargs)
        except Exception as error:
            if not errors:
                errors.append(innermost_tandem_frame(error))
            raise
        finally:
            if checked:
                torch.cuda.set_sync_debug_mode(0)

    runner.launch = checked_launch
    try:
        yield
    finally:
        del runner.launch


def innermost_tandem_frame(error: BaseException) -> dict:
    """``error``'s message and the innermost frame of its traceback in the ``tandem``
    package (``tandem/...:line in function: source``): where a synchronizing call was made."""
    package = os.path.dirname(os.path.dirname(rollout.__file__))  # .../tandem
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if frame.filename.startswith(package + os.sep)]
    where = None
    if frames:
        frame = frames[-1]
        path = os.path.relpath(frame.filename, os.path.dirname(package))
        where = f"{path}:{frame.lineno} in {frame.name}: {frame.line}"
    return dict(error=f"{type(error).__name__}: {error}"[:300], at=where)
