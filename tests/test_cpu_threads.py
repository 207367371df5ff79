"""Pinning an OpenMP team to CPUs: the CPU lists, what ``"auto"`` picks, each thread of the
team on its own CPU, and ``tandem serve``'s engine thread pinned where it runs steps;
releasing a team, and ``tandem serve`` leaving the engine thread's the only one."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch

from tandem.kernels import cpu_build
from tandem.kernels.cpu_threads import bind_threads, cpus_to_bind, parse_cpu_list, release_team
from tandem.rollout.serving.config import ServerConfig

from .test_server import running_uvicorn
from .test_server_limits import completion

ALLOWED = sorted(os.sched_getaffinity(0))
needs_kernels = pytest.mark.skipif(not cpu_build.available(), reason="no C compiler")


@pytest.mark.parametrize(("text", "cpus"), [("3", [3]), ("0-3", [0, 1, 2, 3]),
                                            ("4, 0-1", [4, 0, 1]), ("2-2,7", [2, 7])])
def test_cpu_lists_are_read_as_taskset_writes_them(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(("text", "message"), [
    ("", "not a CPU list"), ("0-", "not a CPU list"), ("a", "not a CPU list"),
    ("-1", "not a CPU list"), ("0;1", "not a CPU list"), ("3-1", "write '1-3'"),
    ("0,0-1", "names a CPU twice")])
def test_bad_cpu_lists_are_refused_naming_the_fix(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cpu_list(text)


def test_server_config_refuses_a_bad_cpu_list_naming_the_field():
    with pytest.raises(ValueError, match="cpu_threads_bind='0-x' is invalid"):
        ServerConfig(cpu_threads_bind="0-x")
    assert ServerConfig(cpu_threads_bind="none").cpu_threads_bind == "none"


@needs_kernels
def test_auto_pins_only_a_team_as_large_as_the_cpus_it_may_use():
    assert cpus_to_bind("auto", len(ALLOWED)) == ALLOWED
    assert cpus_to_bind("auto", len(ALLOWED) + 1) is None
    assert cpus_to_bind("none", len(ALLOWED)) is None
    assert cpus_to_bind("0-1", 2) == [0, 1]
    with pytest.raises(ValueError, match="names 2 CPUs for 3 threads.*OMP_NUM_THREADS"):
        cpus_to_bind("0-1", 3)


def pinned_threads() -> dict[int, set[int]]:
    """Every thread of this process whose CPUs are fewer than the process's, and its CPUs."""
    threads = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            cpus = os.sched_getaffinity(int(task.name))
        except ProcessLookupError:  # the thread ended since the listing
            continue
        if cpus != set(ALLOWED):
            threads[int(task.name)] = cpus
    return threads


def in_new_thread(function):
    """``function()``'s result, run on a new thread (and so with a new OpenMP team)."""
    results: list = []
    worker = threading.Thread(target=lambda: results.append(function()))
    worker.start()
    worker.join(30)
    return results[0]


@needs_kernels
@pytest.mark.parametrize("num_cpus", [1, 2])
def test_each_thread_of_the_callers_team_is_pinned_to_its_own_cpu(num_cpus):
    if len(ALLOWED) < max(num_cpus, 2):
        pytest.skip("needs two CPUs, so that a pinned thread is told apart")
    cpus = ALLOWED[-num_cpus:]
    before = pinned_threads()

    def bind() -> tuple[int, dict[int, set[int]]]:
        bind_threads(cpus)
        return threading.get_native_id(), pinned_threads()  # while the team lives

    caller, pinned = in_new_thread(bind)
    assert pinned.pop(caller) == {cpus[0]}
    team = {tid: cpus for tid, cpus in pinned.items() if tid not in before}
    assert sorted(team.values(), key=min) == [{cpu} for cpu in cpus[1:]]


@needs_kernels
def test_a_cpu_the_process_may_not_use_is_refused():
    with pytest.raises(ValueError, match="not among those this process may use"):
        bind_threads([max(ALLOWED) + 1])


@needs_kernels
def test_serve_runs_its_steps_on_a_thread_pinned_to_the_given_cpus(llama_dir, monkeypatch):
    if len(ALLOWED) < torch.get_num_threads():
        pytest.skip("fewer CPUs than torch threads")
    cpus = ALLOWED[:torch.get_num_threads()]
    with running_uvicorn(llama_dir, cpu_threads_bind=",".join(map(str, cpus))) as (
            url, engine, _, _):
        step_cpus: list[set[int]] = []
        step = engine.step

        def recording_step():
            step_cpus.append(os.sched_getaffinity(0))
            return step()

        monkeypatch.setattr(engine, "step", recording_step)
        assert completion(url, max_tokens=4).status_code == 200
    assert step_cpus and all(c == {cpus[0]} for c in step_cpus)


def thread_ids() -> set[int]:
    return {int(task.name) for task in Path("/proc/self/task").iterdir()}


@needs_kernels
def test_release_team_ends_the_callers_team_and_leaves_others_alone():
    if torch.get_num_threads() < 2:
        pytest.skip("a team of one thread has nothing to release")
    threads_here = torch.get_num_threads()

    def release() -> tuple[set[int], bool, int, set[int]]:
        before = thread_ids()
        torch.ones(1 << 22).sum()  # a parallel region: this new thread's team starts
        team = thread_ids() - before
        released = release_team()
        torch.ones(1 << 22).sum()  # on this thread alone now: no team starts again
        return team, released, torch.get_num_threads(), thread_ids()

    team, released, threads_after, alive = in_new_thread(release)
    assert released and threads_after == 1
    assert len(team) == threads_here - 1 and not team & alive
    assert torch.get_num_threads() == threads_here


@needs_kernels
def test_serve_leaves_the_engine_threads_team_the_only_one(llama_dir, monkeypatch):
    if torch.get_num_threads() < 2:
        pytest.skip("a team of one thread has nothing to release")
    with running_uvicorn(llama_dir) as (url, engine, server, _):
        threads: dict[str, int] = {}
        step, process_prompt = engine.step, engine.process_prompt

        def record() -> None:  # under the executor's name: tandem-engine_0, tandem-input_0
            threads[threading.current_thread().name.split("_")[0]] = torch.get_num_threads()

        def recording_step():
            record()
            return step()

        def recording_process_prompt(prompt):
            record()
            return process_prompt(prompt)

        async def on_loop() -> int:
            return torch.get_num_threads()

        monkeypatch.setattr(engine, "step", recording_step)
        monkeypatch.setattr(engine, "process_prompt", recording_process_prompt)
        assert completion(url, max_tokens=4).status_code == 200
        loop = server.async_engine.loop
        threads["loop"] = asyncio.run_coroutine_threadsafe(on_loop(), loop).result(30)
    assert threads == {"tandem-engine": torch.get_num_threads(), "tandem-input": 1, "loop": 1}
