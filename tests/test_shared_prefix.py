"""Shared prefixes in the trainer's exact forward (``rollout/worker/shared_prefix.py``): the
stream holds each row's longest common prefix with the row before once (against a plain
reference, on hypothesis-drawn groups); the training attention over such tables gives the
unshared stream's bits and autograd's gradients through float64; the shared forward gives
the unshared forward's log-probs, hidden states and loss bit for bit and the engine's sampled
log-probs (a plain model, a sliding window, sinks with experts; float32 and bfloat16; LoRA
merged and at run time; PPO's value head; routing replay), its gradients within float
rounding of the unshared ones and of autograd through transformers; micro-batches keep
groups whole within the cost of their rows; a run that cannot share says why."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from tandem.kernels import select_kernels
from tandem.kernels.differentiable import training_ops
from tandem.kernels.testing import relative_error
from tandem.rollout import LLM, SamplingParams
from tandem.rollout.worker.shared_prefix import token_stream
from tandem.trainers.micro_batches import group_slices, stream_costs
from tandem.trainers.policy import Policy, ValueHead, completion_logprobs, token_batch
from tandem.trainers.routing import RoutingCounts, routing_rows

from .test_attention_sinks_softcap import SCALE, features, float64_stream
from .test_exact_logprobs import assert_exact, assert_gradients_match, sampled
from .test_gpt_oss import gpt_oss_dir  # noqa: F401 - a fixture
from .test_sliding_window import window_dir  # noqa: F401 - a fixture
from .test_trainer import make_config, target_token  # noqa: F401 - a fixture

# Prompts across the tiny models' sliding window (8): shorter, a window and a bit, two.
PROMPTS = [[(7 * i + 3 * j) % 250 + 4 for j in range(length)]
           for i, length in enumerate((5, 11, 19))]
# Stops about one token in four of the tiny models' (near uniform) samples: ragged
# completions, some of one token.
STOPS = list(range(2, 82))
# The largest relative gap between a parameter's shared and unshared gradients: the shared
# backward adds a prefix's gradients once, rows apart, then multiplies the sum (each rounding
# where the unshared one rounded each row's part), so the last bits differ.
GRADIENT_GAP = {"float32": 1e-5, "bfloat16": 3e-2}


def reference_paths(rows: list[list[int]]) -> tuple[list[list[int]], int]:
    """Each row's stream row per token, its longest common prefix with the row before read
    from that row's; and the stream's length."""
    paths, count = [], 0
    for index, row in enumerate(rows):
        previous = rows[index - 1] if index else []
        common = 0
        while common < min(len(row), len(previous)) and row[common] == previous[common]:
            common += 1
        paths.append(paths[-1][:common] + list(range(count, count + len(row) - common))
                     if common else list(range(count, count + len(row))))
        count += len(row) - common
    return paths, count


TOKENS = st.integers(2, 40)  # few: tokens repeat, and completions share starts by chance


@st.composite
def groups(draw) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """Prompts, completions and group ids: 1-3 prompts (1-12 tokens after a system line
    all share, maybe none), each a group of 1-4 completions, each an earlier turn its group
    shares (the multi-turn case; maybe none) and its own tokens (maybe none)."""
    prompts, completions, group_ids = [], [], []
    system = draw(st.lists(TOKENS, max_size=4))
    for group in range(draw(st.integers(1, 3))):
        prompt = system + draw(st.lists(TOKENS, min_size=1, max_size=12))
        turn = draw(st.lists(TOKENS, max_size=4))
        for _ in range(draw(st.integers(1, 4))):
            prompts.append(prompt)
            completions.append(turn + draw(st.lists(TOKENS, max_size=5)))
            group_ids.append(group)
    return prompts, completions, torch.tensor(group_ids)


def stream_of(batch, share: bool = True):
    """``token_stream`` of ``batch`` by token and position, as the exact forward's."""
    keys = torch.stack([batch.input_ids, batch.position_ids], -1)
    return token_stream(keys, batch.attention_mask, share)


@settings(max_examples=60, deadline=None)
@given(rows=groups())
def test_the_stream_holds_each_rows_prefix_shared_with_the_row_before_once(rows):
    prompts, completions, _ = rows
    batch = token_batch(prompts, completions, 0)
    stream, real = stream_of(batch), batch.attention_mask.bool()
    tokens = [p + c for p, c in zip(prompts, completions)]
    paths, count = reference_paths(tokens)
    assert stream.num_tokens == count
    assert stream_of(batch, share=False).num_tokens == sum(map(len, tokens))
    assert [stream.places[b][real[b]].tolist() for b in range(len(tokens))] == paths
    assert (stream.places[~real] == -1).all()
    ids = batch.input_ids[real][stream.sources]
    assert all(ids[path].tolist() == row for path, row in zip(paths, tokens))
    # One sequence per row with tokens of its own: those its queries, its row its table.
    metadata, bounds = stream.metadata, stream.metadata.cu_seqlens_q.tolist()
    own = [(path, stream.added[b]) for b, path in enumerate(paths) if stream.added[b]]
    assert len(own) == len(metadata.context_lens)
    for index, (path, added) in enumerate(own):
        assert metadata.context_lens[index] == len(path)
        assert metadata.block_tables[index, :len(path)].tolist() == path
        assert list(range(bounds[index], bounds[index + 1])) == path[len(path) - added:]


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("window,feature", [(None, None), (5, None), (None, "both"),
                                            (5, "sinks")])
def test_attention_over_shared_rows_has_the_unshared_bits_and_autograds_gradients(
        backend, window, feature):
    # Two groups (a 9-token prompt: completions of 4, 0 and 6 tokens after a shared turn;
    # a 1-token prompt: 3 and 1), GQA (2 KV heads of 3 query heads).
    turn = [30, 31]
    batch = token_batch([list(range(3, 12))] * 3 + [[5]] * 2,
                        [turn + [7, 8], turn, turn + [9, 10, 11, 12], [6, 7, 8], [9]], 0)
    shared, unshared = stream_of(batch), stream_of(batch, share=False)
    assert shared.num_tokens == (9 + 4) + 0 + 4 + (1 + 3) + 1
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(shared.num_tokens, heads, 16, generator=generator).requires_grad_()
               for heads in (6, 2, 2))
    kwargs = features(feature, 6) if feature else {"sinks": None, "softcap": None}
    if kwargs["sinks"] is not None:
        kwargs["sinks"] = torch.nn.Parameter(kwargs["sinks"])
    ops = training_ops(select_kernels(backend, torch.device("cpu"), exact=True))
    spread = shared.places[batch.attention_mask.bool()]  # each row's own copy of its tokens
    out = ops.causal_attention(q, k, v, shared.metadata, SCALE, sliding_window=window,
                               **kwargs)
    whole = ops.causal_attention(q[spread], k[spread], v[spread], unshared.metadata, SCALE,
                                 sliding_window=window, **kwargs)
    assert torch.equal(out[spread], whole)
    # Against autograd through each row attending its own copy, in float64: the gradients
    # of the shared rows are every row's added.
    trained = [t for t in (q, k, v, kwargs["sinks"]) if t is not None]
    grad = torch.randn(out.shape, generator=generator)
    grads = torch.autograd.grad(out, trained, grad)
    doubles = [t.detach().double().requires_grad_() for t in trained]
    rows = float64_stream(*(d[spread] for d in doubles[:3]), unshared.metadata.cu_seqlens_q,
                          window, *doubles[3:], softcap=kwargs["softcap"])
    expected = torch.autograd.grad(rows[shared.sources], doubles, grad.double())
    for found, wanted in zip(grads, expected, strict=True):
        assert relative_error(found, wanted) < 1e-5


@pytest.fixture(scope="module")
def folder(model_dir, window_dir, gpt_oss_dir):  # noqa: F811 - the fixtures imported
    """A factory: the folder of the tiny model of a kind: ``llama``, ``window`` (Qwen3, a
    sliding layer and a full one) or ``sinks`` (GPT-OSS: sinks, windows, experts)."""
    kinds = {"llama": lambda: model_dir("llama"), "window": lambda: window_dir("qwen3"),
             "sinks": lambda: gpt_oss_dir()}
    return lambda kind: kinds[kind]()


def forward_backward(forward, model, batch, temperature: float = 1.0):
    """The completions' log-probs through ``forward``, a loss over them (random
    advantages, per token), and every parameter's gradient after its backward."""
    model.zero_grad(set_to_none=True)
    logprobs, _, _ = completion_logprobs(forward, batch, temperature)
    advantages = torch.randn(len(logprobs), 1, generator=torch.Generator().manual_seed(1))
    mask = batch.completion_mask
    loss = -(advantages * logprobs * mask).sum() / mask.sum()
    loss.backward()
    return logprobs.detach(), loss.detach(), {name: p.grad.clone() for name, p in
                                              model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["llama", "window", "sinks"])
def test_sharing_keeps_the_samplers_logprobs_and_the_loss_bit_for_bit(folder, kind, dtype):
    # Groups of 3 sampled by the engine (chunked prefill, prompts past the window, ragged
    # completions): the shared forward's log-probs are the engine's, and with the loss the
    # unshared forward's; the gradients are the unshared ones within float rounding.
    path = folder(kind)
    llm = LLM(str(path), dtype=dtype, max_model_len=64, max_num_batched_tokens=16,
              block_size=4)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=3, logprobs=0, n=3,
                            stop_token_ids=STOPS)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params, PROMPTS)
    assert len({len(c) for c in completions}) > 1  # ragged
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    batch = token_batch(prompts, completions, 0)
    assert stream_of(batch).num_tokens < stream_of(batch, share=False).num_tokens
    (logprobs, loss, grads), (unshared, unshared_loss, unshared_grads) = (
        forward_backward(llm.exact_forward(model, shared_prefix=share), model, batch)
        for share in (True, False))
    assert_exact(logprobs, batch.completion_mask, sampler_logprobs)
    assert torch.equal(logprobs, unshared) and torch.equal(loss, unshared_loss)
    assert grads.keys() == unshared_grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, unshared_grads[name]) < GRADIENT_GAP[dtype], name


@pytest.fixture(scope="module")
def llama_forwards(llama_dir):
    """The tiny Llama's exact forward, sharing (True) and not (False)."""
    llm = LLM(str(llama_dir), max_model_len=128)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    return {share: llm.exact_forward(model, shared_prefix=share) for share in (True, False)}


@settings(max_examples=20, deadline=None)
@given(rows=groups())
def test_any_groups_give_every_row_the_unshared_bits(llama_forwards, rows):
    prompts, completions, _ = rows
    batch = token_batch(prompts, completions, 0)
    outputs = []
    with torch.no_grad():
        for share in (True, False):
            outputs.append(llama_forwards[share](
                input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, logits_to_keep=batch.num_completion_slots + 1,
                output_hidden_states=True))
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].hidden_states[-1], outputs[1].hidden_states[-1])


def multi_turn(prompts, completions):
    """Each completion after an earlier turn its group shares (its group's first
    completion and two tokens of an environment's reply)."""
    turns = {}
    for prompt, completion in zip(prompts, completions):
        turns.setdefault(tuple(prompt), completion + [5, 6])
    return [turns[tuple(p)] + c for p, c in zip(prompts, completions)]


def test_shared_gradients_match_autograd_through_transformers(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=128)
    params = SamplingParams(max_tokens=8, seed=1, n=3, stop_token_ids=STOPS)
    prompts, completions, _, _ = sampled(llm, params, PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    batch = token_batch(prompts, multi_turn(prompts, completions), 0)
    assert llm.exact_forward(model).shared_prefix
    assert_gradients_match(llm, model, batch, 1e-4)


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_a_lora_adapter_stays_exact_with_sharing(llama_dir, mode):
    from peft import LoraConfig, get_peft_model

    from tandem.sync import LoraSync, peft_adapter_state

    llm = LLM(str(llama_dir), max_model_len=128)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    LoraSync(llm, mode=mode).update(*peft_adapter_state(model))
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=2, logprobs=0, n=3,
                            stop_token_ids=STOPS)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params, PROMPTS)
    batch = token_batch(prompts, completions, 0)
    logprobs, unshared = (completion_logprobs(
        llm.exact_forward(model, lora_runtime=mode == "runtime", shared_prefix=share),
        batch, 1.0)[0] for share in (True, False))
    assert_exact(logprobs, batch.completion_mask, sampler_logprobs)
    assert torch.equal(logprobs, unshared)


def test_the_value_head_reads_each_rows_own_hidden_states(llama_dir):
    # PPO's values come from the kept hidden states: the same bits shared or not, and
    # transformers' values within float tolerance.
    llm = LLM(str(llama_dir), max_model_len=128)
    prompts, completions, _, _ = sampled(
        llm, SamplingParams(max_tokens=8, seed=4, n=3, stop_token_ids=STOPS), PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    policy = Policy(model, ValueHead(model.config.hidden_size))
    torch.nn.init.normal_(policy.value_head.weight, generator=torch.Generator().manual_seed(5))
    batch = token_batch(prompts, multi_turn(prompts, completions), 0)
    values = []
    with torch.no_grad():
        for forward in (llm.exact_forward(model), llm.exact_forward(model, shared_prefix=False),
                        None):
            policy.use_exact_forward(forward)
            values.append(policy(batch, 1.0)[1] * batch.completion_mask)
    assert torch.equal(values[0], values[1])
    assert relative_error(values[0], values[2]) < 1e-5


def test_routing_replay_with_sharing_is_the_samplers(gpt_oss_dir):  # noqa: F811
    # The rows share a position only where the sampler's routing agrees too; replayed, the
    # log-probs are the sampler's and the unshared forward's, the agreement counted row by
    # row as unshared; a routing unlike the router's own replays alike.
    llm = LLM(str(gpt_oss_dir()))
    params = SamplingParams(n=3, max_tokens=6, seed=1, logprobs=0, return_routed_experts=True,
                            stop_token_ids=STOPS)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    prompts = [p for p, o in zip(PROMPTS, outputs, strict=True) for _ in o.outputs]
    completions = [c for o in outputs for c in o.outputs]
    batch = token_batch(prompts, [c.token_ids for c in completions], 0)
    width = batch.input_ids.shape[1]
    batch.routing = routing_rows([c.routed_experts for c in completions],
                                 [len(p) for p in prompts], width - batch.num_completion_slots,
                                 width)
    keys = torch.cat([torch.stack([batch.input_ids, batch.position_ids], -1),
                      batch.routing.flatten(2)], -1)
    assert token_stream(keys, batch.attention_mask).num_tokens < \
        stream_of(batch, share=False).num_tokens
    policy = Policy(AutoModelForCausalLM.from_pretrained(gpt_oss_dir(), dtype=torch.float32))
    policy.routing_replay = True
    routings = {"sampler": batch.routing,
                "shifted": torch.where(batch.routing >= 0, (batch.routing + 1) % 4, -1)}
    runs = {}
    with torch.no_grad():
        for share in (True, False):
            policy.use_exact_forward(llm.exact_forward(policy.model, shared_prefix=share))
            for name, routing in routings.items():
                policy.routing_counts = RoutingCounts()
                batch.routing = routing
                logprobs, _, _ = policy(batch, 1.0)
                runs[share, name] = (logprobs, policy.routing_counts)
    assert_exact(runs[True, "sampler"][0], batch.completion_mask,
                 [c.logprobs for c in completions])
    for name in ("sampler", "shifted"):
        (logprobs, counts), (unshared, unshared_counts) = runs[True, name], runs[False, name]
        assert torch.equal(logprobs, unshared) and counts == unshared_counts


@settings(max_examples=60, deadline=None)
@given(rows=groups(), size=st.integers(1, 6))
def test_micro_batches_keep_groups_whole_within_the_cost_of_their_rows(rows, size):
    prompts, completions, group_ids = rows
    batch = token_batch(prompts, completions, 0)
    slices = group_slices(batch, group_ids, size)
    assert [s.start for s in slices] == [0, *(s.stop for s in slices[:-1])]
    assert slices[-1].stop == len(prompts)
    shared, whole = (stream_costs(batch, group_ids, share) for share in (True, False))
    budget = size * float(whole.float().mean())
    ids = group_ids.tolist()

    def cost(start: int, end: int) -> float:
        return float(whole[start] + shared[start + 1:end].sum())

    for piece in slices:
        assert cost(piece.start, piece.stop) <= budget or piece.stop - piece.start == 1
        if piece.stop == len(ids):
            continue
        # Closed where the next group (or, inside a group over the budget, the next row)
        # would pass it; a group cut only where it alone passes it.
        group = [row for row in range(len(ids)) if ids[row] == ids[piece.stop]]
        inside = group[0] < piece.stop
        assert cost(piece.start, piece.stop + 1 if inside else group[-1] + 1) > budget
        assert not inside or cost(group[0], group[-1] + 1) > budget


def test_a_run_that_cannot_share_says_why(llama_dir, tmp_path, target_token,  # noqa: F811
                                          capsys):
    from tandem.trainers.trainer import Trainer

    trainer = Trainer(make_config(llama_dir, tmp_path, target_token, exact_logprobs=False))
    assert trainer.policy.exact_forward is None
    out = capsys.readouterr().out
    assert "shared_prefix" in out and "exact_logprobs: false" in out


def test_a_ppo_step_shares_and_stays_exactly_on_policy(llama_dir, tmp_path,
                                                       target_token):  # noqa: F811
    # The value head reads the shared forward's hidden states; micro-batches of whole
    # groups (8 rows each, micro_batch_size 12).
    from tandem.trainers.trainer import Trainer

    trainer = Trainer(make_config(llama_dir, tmp_path, target_token, algorithm="ppo", steps=1))
    assert trainer.policy.exact_forward.shared_prefix
    metrics = trainer.train_step()
    assert metrics["sampler_logprob_diff_max"] == 0.0
    assert torch.isfinite(torch.tensor(metrics["loss"]))
