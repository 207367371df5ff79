"""The GPU check's engine sections: greedy tokens of the Triton path against torch's, the
memory share with sleep and wake, the engine's lifecycle, and the four kinds of weight update
against a fresh engine (decode and nano-bench: ``gpu_check_throughput.py``).

Every section builds its own engines inside its own functions and lets them go on return, so
the next section starts with the device as the check found it (``gpu_check.py`` records what
is still held between sections)."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import sync as sync_benchmark  # benchmarks/sync.py
import torch
from gpu_check_common import (
    Recorder,
    collect,
    device_total_bytes,
    device_used_bytes,
    live_engines,
    load_hf_model,
    make_llm,
    timed,
    vocab_size,
)
from safetensors.torch import save_file

from tandem.kernels.testing import TOLERANCE, relative_error
from tandem.rollout import LLM, SamplingParams
from tandem.sync import LoraSpec, LoraSync


def random_prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    """``count`` prompts of random ids in [2, 500), lengths uniform in [low, high)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (int(n),), generator=generator).tolist()
            for n in torch.randint(low, high, (count,), generator=generator)]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions of ``prompts`` (EOS ignored)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def seeded(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list, list]]:
    """Seeded samples (temperature 1, seed = prompt index): tokens and their log-probs."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             logprobs=0) for i in range(len(prompts))]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(prompts, params, use_tqdm=False)]


def compare_samples(got: list[tuple[list, list]], want: list[tuple[list, list]]) -> dict:
    """Equal sequences and the largest log-prob gap over the tokens both sampled alike."""
    equal = sum(a[0] == b[0] for a, b in zip(got, want))
    gaps = [abs(x - y) for a, b in zip(got, want) if a[0] == b[0]
            for x, y in zip(a[1], b[1])]
    return dict(equal_sequences=f"{equal}/{len(want)}", logprob_gap=max(gaps, default=None),
                ok=equal == len(want) and max(gaps, default=0.0) == 0.0)


# ---------------------------------------------------------------- greedy tokens


def check_tokens(rec: Recorder, folder: Path) -> None:
    """Greedy tokens, Triton (eager and graphs) against the torch backend on one model: every
    sequence equal in float32; in bfloat16 a divergence passes only at a near-tie, where the
    float32 transformers model's top-2 logits differ by under bfloat16's spacing."""
    prompts = random_prompts(3 if rec.smoke else 8, 5, 20 if rec.smoke else 200, seed=2)
    max_tokens = 3 if rec.smoke else 32
    for dtype in ("float32", "bfloat16"):
        tokens = {}
        for name, options in (("torch", dict(attention_backend="torch")),
                              ("triton eager", dict(attention_backend="triton",
                                                    enforce_eager=True)),
                              ("triton graphs", dict(attention_backend="triton"))):
            tokens[name] = greedy(make_llm(rec, folder, dtype=dtype, **options), prompts,
                                  max_tokens)
            collect()
        for name in ("triton eager", "triton graphs"):
            record_token_check(rec, folder, dtype, name, prompts, tokens[name], tokens["torch"])
        check_overlap_tokens(rec, folder, dtype)


def check_overlap_tokens(rec: Recorder, folder: Path, dtype: str) -> None:
    """Seeded sampling with overlapped steps against the landed path on one engine (its
    switch flipped), stop tokens drawn often enough that stopped sequences run their extra
    step: the same tokens (the log-prob gap recorded: a widened batch may round otherwise)."""
    llm = make_llm(rec, folder, dtype=dtype)
    prompts = random_prompts(4 if rec.smoke else 16, 5, 20 if rec.smoke else 200, seed=3)
    stops = list(range(100, 100 + vocab_size(folder) // 64))  # about 1.6% of the draws
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=8 if rec.smoke else 96,
                             logprobs=0, stop_token_ids=stops) for i in range(len(prompts))]
    samples = {}
    for overlap in (False, True):
        llm.engine.steps.overlap = overlap
        samples[overlap] = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                            for o in llm.generate(prompts, params, use_tqdm=False)]
    row = compare_samples(samples[True], samples[False])
    lengths = [len(tokens) for tokens, _ in samples[False]]
    row["ok"] = row["equal_sequences"] == f"{len(prompts)}/{len(prompts)}"
    rec.record("tokens", "seeded, overlap on = off", dtype=dtype, lengths=lengths, **row)
    del llm
    collect()


def record_token_check(rec: Recorder, folder: Path, dtype: str, name: str,
                       prompts: list[list[int]], got: list[list[int]],
                       want: list[list[int]]) -> None:
    equal = sum(a == b for a, b in zip(got, want))
    row = dict(dtype=dtype, equal_sequences=f"{equal}/{len(want)}")
    if dtype == "float32" or equal == len(want):
        rec.record("tokens", f"greedy, {name} = torch", **row, ok=equal == len(want))
        return
    margins = divergence_margins(rec, folder, prompts, got, want)
    rec.record("tokens", f"greedy, {name} = torch", **row, divergences=margins,
               ok=all(m["margin"] <= m["bf16_spacing"] for m in margins))


def divergence_margins(rec: Recorder, folder: Path, prompts: list[list[int]],
                       got: list[list[int]], want: list[list[int]]) -> list[dict]:
    """At each sequence's first differing token: the float32 logit margin between the two
    tokens chosen, and bfloat16's spacing at that logit's size (2^-7 of it)."""
    model = load_hf_model(folder, torch.float32, rec.device)
    margins = []
    for prompt, a, b in zip(prompts, got, want):
        if a == b:
            continue
        at = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.no_grad():
            ids = torch.tensor([prompt + b[:at]], device=rec.device)
            logits = model(ids).logits[0, -1].double()
        high = max(abs(float(logits[a[at]])), abs(float(logits[b[at]])))
        margins.append(dict(position=at, margin=abs(float(logits[a[at]] - logits[b[at]])),
                            bf16_spacing=2.0 ** (int(torch.tensor(high).log2().floor()) - 7)))
    del model
    collect()
    return margins


# ---------------------------------------------------------------- memory, sleep, lifecycle


def check_memory(rec: Recorder, folder: Path) -> None:
    """The engine's share of the device at start and under load against
    ``gpu_memory_utilization`` x total, then the KV pool alone released and sleep at both
    of vLLM's levels, each woken (level 2 with the full update that must follow): their
    seconds, what stays held asleep, and seeded sampling after wake against before."""
    utilization = 0.35
    baseline = device_used_bytes()
    llm = make_llm(rec, folder, **({} if rec.smoke else
                                   {"gpu_memory_utilization": utilization}))
    target = utilization * device_total_bytes()
    share = {"at start": device_used_bytes() - baseline}
    heavy = random_prompts(8 if rec.smoke else 512, 100, 400, seed=3)
    llm.generate(heavy, SamplingParams(max_tokens=8 if rec.smoke else 256, ignore_eos=True),
                 use_tqdm=False)
    share["under load"] = device_used_bytes() - baseline
    for when, used in share.items():
        rec.record("memory", f"engine share {when}", gib=round(used / 2**30, 2),
                   of_target=round(used / target, 3) if target else None,
                   ok=used <= target if target else None)
    prompts = random_prompts(4 if rec.smoke else 8, 10, 60, seed=4)
    before = seeded(llm, prompts, 8 if rec.smoke else 24)
    kept = [(name, t.to("cpu", copy=True)) for name, t in llm.engine.weight_parameters().items()]
    sleeps = {"release_kv_cache_memory()": llm.release_kv_cache_memory,
              "sleep(1)": lambda: llm.sleep(1), "sleep(2)": lambda: llm.sleep(2)}
    for name, sleep in sleeps.items():
        sleep_seconds = timed(sleep)
        held = device_used_bytes() - baseline
        wake_seconds = timed(llm.wake_up)
        parts = {k: round(v, 4) for k, v in llm.stats().items()
                 if k.startswith(("sleep_", "wake_")) and isinstance(v, float)}
        # sleep(2) discarded the weights: the full update a trainer sends brings them back
        update = {"update_after_wake": round(timed(lambda: llm.update_weights(kept)), 3)} \
            if name == "sleep(2)" else {}
        rec.record("memory", name, timed_sleep=round(sleep_seconds, 3),
                   timed_wake=round(wake_seconds, 3), held_asleep_gib=round(held / 2**30, 2),
                   graphs=llm.stats()["num_decode_graphs"], **update, **parts)
        after = seeded(llm, prompts, 8 if rec.smoke else 24)
        rec.record("memory", f"seeded sampling after {name} = before",
                   **compare_samples(after, before))


def check_lifecycle(rec: Recorder, folder: Path) -> None:
    """An engine deleted by its only owner gives its device memory back."""
    baseline = device_used_bytes()
    llm = make_llm(rec, folder)
    llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=4), use_tqdm=False)
    alive = device_used_bytes() - baseline
    del llm
    collect()
    after = device_used_bytes() - baseline
    rec.record("lifecycle", "engine deleted by its only owner", held_alive_gib=round(
        alive / 2**30, 2), held_after_del_gib=round(after / 2**30, 2),
        engines_alive=live_engines(), ok=live_engines() == 0 and after < 0.05 * max(alive, 1))


# ---------------------------------------------------------------- weight updates


def save_weights(base: Path, folder: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A copy of ``base``'s config and tokenizer with ``weights`` as its checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in base.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            shutil.copy(path, folder / path.name)
    save_file({name: t.detach().contiguous().cpu() for name, t in weights.items()},
              folder / "model.safetensors")
    return folder


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Each weight times (1 + 0.1 · noise): new weights of the same scale."""
    generator = torch.Generator(device=next(iter(weights.values())).device).manual_seed(seed)
    return {name: (t.float() * (1 + 0.1 * torch.randn(t.shape, generator=generator,
                                                        device=t.device))).to(t.dtype)
            for name, t in weights.items()}


def device_adapter(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``benchmarks/sync.py``'s seeded rank-16 adapter on every projection, on the weights'
    device."""
    device = next(iter(weights.values())).device
    return {name: t.to(device) for name, t in sync_benchmark.lora_adapter(weights).items()}


def merged_reference(weights: dict[str, torch.Tensor], adapter: dict, scale: float) -> dict:
    """``W + scale · B A`` in float32, rounded to each weight's dtype (PEFT's merge)."""
    merged = dict(weights)
    for name in weights:
        a = adapter.get(name.replace(".weight", ".lora_A.weight"))
        if a is not None:
            b = adapter[name.replace(".weight", ".lora_B.weight")]
            merged[name] = (weights[name].float() + scale * (b.float() @ a.float())).to(
                weights[name].dtype)
    return merged


def check_updates(rec: Recorder, folder: Path, work: Path) -> None:
    """Copy, alias and LoRA-merge updates of a running engine (graphs on, each prompt sampled
    before the update so a stale prefix cache or graph would show) against a fresh engine on
    the same weights saved; the run-time LoRA layers against ``x W^T + s (x A^T) B^T``."""
    prompts = random_prompts(8, 10, 80, seed=5)
    tokens = 8 if rec.smoke else 24
    llm = make_llm(rec, folder, max_num_seqs=16)
    weights = {n: p.detach().clone() for n, p in llm.engine.weight_parameters().items()}
    seeded(llm, prompts, tokens)
    copy = perturbed(weights, seed=1)
    seconds = timed(functools.partial(llm.update_weights, copy.items()))
    gigabytes = sum(t.nbytes for t in copy.values()) / 1e9
    check_against_fresh(rec, "full copy update", llm, save_weights(folder, work / "copy", copy),
                        prompts, tokens, seconds=round(seconds, 4),
                        gb_s=round(gigabytes / seconds, 1))
    alias = perturbed(weights, seed=2)
    llm.update_weights(alias.items(), alias=True)
    check_against_fresh(rec, "alias update", llm, save_weights(folder, work / "alias", alias),
                        prompts, tokens)
    spec = LoraSpec(r=sync_benchmark.LORA_RANK, lora_alpha=2 * sync_benchmark.LORA_RANK,
                    target_modules=list(sync_benchmark.PROJECTIONS))
    adapter = device_adapter(alias)
    merged = merged_reference(alias, adapter, spec.scale)  # before the merge writes `alias`
    LoraSync(llm).update(adapter.items(), spec)
    check_against_fresh(rec, "LoRA merge", llm, save_weights(folder, work / "lora", merged),
                        prompts, tokens)
    del llm
    collect()
    check_lora_runtime(rec, folder, device_adapter(weights), spec)


def check_against_fresh(rec: Recorder, name: str, llm: LLM, saved: Path,
                        prompts: list[list[int]], tokens: int, **values) -> None:
    """``llm``'s seeded samples against a fresh engine's on the ``saved`` weights. On a CPU
    (the smoke run) the fresh engine multiplies in ``llm``'s linear layout: an alias update
    ends an engine's timed layout for good (it multiplies the weights as stored), and the
    layout a fresh engine times (a near tie at the smoke run's sizes, timed anew whenever
    the compiled kernels change) must not decide a bitwise comparison."""
    got = seeded(llm, prompts, tokens)
    fresh = make_llm(rec, saved, max_num_seqs=16)
    same_linear_layout(fresh, llm)
    want = seeded(fresh, prompts, tokens)
    del fresh
    collect()
    rec.record("updates", f"{name} = fresh engine", **values, **compare_samples(got, want))


def same_linear_layout(fresh: LLM, llm: LLM) -> None:
    """On a CPU, have ``fresh`` multiply in ``llm``'s linear layout (each engine times its
    own when it loads: see ``check_against_fresh``); a no-op on CUDA."""
    if fresh.engine.runner.device.type == "cpu":
        fresh.engine.runner.model.pack_linear_weights(llm.engine.runner.model.linear_layout)


def check_lora_runtime(rec: Recorder, folder: Path, adapter: dict, spec: LoraSpec) -> None:
    """Every run-time LoRA layer's output against ``x W^T + s (x A^T) B^T`` computed by torch
    in the engine's dtype, both measured against float64."""
    llm = make_llm(rec, folder, max_num_seqs=16)
    LoraSync(llm, mode="runtime").update(adapter.items(), spec)
    generator = torch.Generator(device=rec.device).manual_seed(6)
    worst, worst_torch = 0.0, 0.0
    for name, layer in llm.engine.runner.lora_layers().items():
        a = adapter[name.replace(".weight", ".lora_A.weight")]
        b = adapter[name.replace(".weight", ".lora_B.weight")]
        weight = layer.weight
        x = torch.randn(64, weight.shape[1], device=rec.device, generator=generator).to(
            weight.dtype)
        with torch.no_grad():
            out = layer(x)
            same_dtype = (torch.nn.functional.linear(x, weight) + spec.scale * torch.nn.functional
                          .linear(torch.nn.functional.linear(x, a.to(x.dtype)), b.to(x.dtype)))
            exact = x.double() @ weight.double().T + spec.scale * (
                x.double() @ a.double().T @ b.double().T)
        worst = max(worst, relative_error(out, exact))
        worst_torch = max(worst_torch, relative_error(same_dtype, exact))
    dtype = next(iter(llm.engine.weight_parameters().values())).dtype
    rec.record("updates", "LoRA runtime layers = x W + s (x A) B", layers=len(
        llm.engine.runner.lora_layers()), rel_error=worst, torch_same_dtype_rel_error=worst_torch,
        ok=worst <= max(2 * worst_torch, TOLERANCE[dtype]))
