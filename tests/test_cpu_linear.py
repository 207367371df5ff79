"""The CPU linear layers' layouts: oneDNN's packed copies, the panels and column-major weights
equal the plain matmul and never serve stale weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tandem.kernels import cpu_build, cpu_linear, quantization
from tandem.kernels.cpu_linear import PackedWeight
from tandem.kernels.testing import TOLERANCE, relative_error
from tandem.rollout import LLM
from tandem.rollout.worker.models.layers import Linear

from .test_weight_update import completions, fresh_completions, trainer_model

LAYOUTS = [layout for layout in cpu_linear.candidate_layouts(torch.float32) if layout]
ONEDNN = [layout for layout in LAYOUTS if layout == "onednn"]  # where oneDNN packs float32
COPIES = [layout for layout in LAYOUTS if layout in cpu_linear.COPIES]
PANELS = [layout for layout in LAYOUTS if layout == "panels"]  # where the C kernels build


def packed_weights(llm: LLM) -> list[PackedWeight]:
    return llm.engine.runner.model.packed_weights()


def linear_layer(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_each_layout_equals_the_plain_matmul(rows, bias, layout):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 40, generator=generator)
    b = torch.randn(48, generator=generator) if bias else None
    x = torch.randn(rows, 40, generator=generator)
    layer = linear_layer(weight, b)
    if layout in cpu_linear.COPIES:
        out = PackedWeight([layer], layout)(x)
    else:
        cpu_linear.store_column_major(layer.weight, True)
        assert layer.weight.t().is_contiguous() and torch.equal(layer.weight, weight)
        out = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", COPIES)
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_layers_give_each_layers_output_side_by_side(rows, bias, layout):
    generator = torch.Generator().manual_seed(rows)
    layers = [linear_layer(torch.randn(out, 40, generator=generator),
                           torch.randn(out, generator=generator) if bias else None)
              for out in (48, 16, 16)]
    x = torch.randn(rows, 40, generator=generator)
    expected = torch.cat([F.linear(x, layer.weight, layer.bias) for layer in layers], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(PackedWeight(layers, layout)(x), expected, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.skipif(not cpu_build.available(), reason="no C compiler")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17])
@pytest.mark.parametrize(("out_features", "bias"), [(37, True), (48, False), (5, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_panel_kernel_equals_the_float64_matmul(rows, out_features, bias, dtype):
    # Outputs not a multiple of the panel (a padded last panel) and inputs not a multiple
    # of the accumulation block; rows through every unrolled row count and their tails.
    # bfloat16: the float64 result of the same bfloat16 values, rounded once.
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, 100, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    x = torch.randn(rows, 100, generator=generator).to(dtype)
    out = cpu_linear.panel_linear(x, cpu_linear.panel_layout(weight), out_features, b)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-5)
    else:  # within one bfloat16 unit in the last place of the rounded exact result
        ulp = expected.abs().clamp_min(1e-3) * 2.0**-7
        assert ((out.double() - expected).abs() <= ulp).all()


@pytest.mark.skipif(not cpu_build.available(), reason="no C compiler")
@pytest.mark.parametrize("counts", [[3, 0, 14, 1], [0, 0, 5, 0], [40, 13, 0, 27]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_experts_each_equal_the_float64_matmul_and_their_rows_alone(counts, dtype):
    # Experts with no rows, a few, and more than a register block; 37 outputs (a padded
    # last panel), 100 inputs (a partial accumulation block).
    generator = torch.Generator().manual_seed(sum(counts))
    weights = torch.randn(len(counts), 37, 100, generator=generator).to(dtype)
    x = torch.randn(sum(counts), 100, generator=generator).to(dtype)
    offsets = torch.tensor([0, *counts]).cumsum(0)
    panels = torch.stack([cpu_linear.panel_layout(w) for w in weights])
    out = cpu_linear.grouped_panel_linear(x, panels, offsets, 37)
    for expert, (start, stop) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        rows = x[start:stop]
        expected = F.linear(rows.double(), weights[expert].double())
        torch.testing.assert_close(out[start:stop].double(), expected,
                                   rtol=1e-6 if dtype == torch.float32 else 2.0**-7,
                                   atol=1e-5 if dtype == torch.float32 else 1e-2)
        for row in range(start, stop):  # the same bits as the row multiplied alone
            alone = cpu_linear.panel_linear(x[row:row + 1], panels[expert], 37, None)
            assert torch.equal(out[row:row + 1], alone)


@pytest.mark.skipif(not cpu_build.available(), reason="no C compiler")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17, 64])
@pytest.mark.parametrize(("out_features", "bias"), [(37, True), (48, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("method", quantization.QUANTIZATIONS)
def test_the_panel_kernel_of_8_bit_weights_equals_the_float64_dequantized_matmul(
        rows, out_features, bias, dtype, method):
    # 8-bit codes converted in registers, summed in float32, each output scaled once:
    # against float64 on the dequantized weight (scale x code), all through the same edges
    # as the float kernel; per-channel scales over five decades.
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, 100, generator=generator) * torch.logspace(
        -2, 3, out_features)[:, None]
    codes, scale = quantization.quantize(weight, method)
    b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    x = torch.randn(rows, 100, generator=generator).to(dtype)
    out = cpu_linear.panel_linear(x, cpu_linear.panel_layout(codes), out_features, b, scale)
    served = codes.double() * scale.double()[:, None]
    expected = F.linear(x.double(), served, None if b is None else b.double())
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert ((out.double() - expected).abs() <= 1e-6 * expected.abs() + 1e-6 * (
            x.double().abs() @ served.abs().t())).all()
    else:  # within one bfloat16 unit in the last place of the rounded exact result
        ulp = expected.abs().clamp_min(1e-3) * 2.0**-7
        assert ((out.double() - expected).abs() <= ulp).all()


@pytest.mark.skipif(not cpu_build.available(), reason="no C compiler")
@pytest.mark.parametrize("flush_denormals", [False, True])
def test_every_fp8_code_converts_exactly_subnormals_included(flush_denormals):
    # The 254 finite e4m3 codes (+-0 and 14 subnormals among them: exponent field 0), each
    # picked out by a one-hot row: the kernel's conversion is exact, even with the CPU's
    # denormals flushed (DAZ and FTZ, on the one thread the kernel runs on).
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[~codes.float().isnan()]
    assert (finite.view(torch.uint8) & 0x78 == 0).sum() == 16
    weight = finite.repeat(20, 1)  # 20 outputs: a full panel and a padded one
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.set_flush_denormal(flush_denormals)
        out = cpu_linear.panel_linear(torch.eye(len(finite)), cpu_linear.panel_layout(weight),
                                      20, None, torch.ones(20))
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    assert torch.equal(out, finite.float()[:, None].expand(-1, 20))


@pytest.mark.skipif(not cpu_build.available(), reason="no C compiler")
@pytest.mark.parametrize("method", quantization.QUANTIZATIONS)
def test_8_bit_panels_refuse_missing_scales_and_scales_refuse_float_panels(method):
    codes, scale = quantization.quantize(torch.randn(16, 8), method)
    with pytest.raises(ValueError, match="panels take float32 scales"):
        cpu_linear.panel_linear(torch.randn(1, 8), cpu_linear.panel_layout(codes), 16, None)
    with pytest.raises(ValueError, match="panels take no scales"):
        cpu_linear.panel_linear(torch.randn(1, 8), cpu_linear.panel_layout(torch.randn(16, 8)),
                                16, None, scale)


@pytest.mark.skipif(not cpu_build.available(), reason="no C compiler")
@pytest.mark.parametrize("method", quantization.QUANTIZATIONS)
def test_a_packed_weight_of_quantized_layers_follows_their_codes_and_scales(method):
    # q/k/v quantized each on its own, packed as one: side by side, and rebuilt after an
    # in-place write of one layer's codes and scale (a weight update's commit).
    generator = torch.Generator().manual_seed(3)
    layers = [Linear(40, out, bias=index == 0) for index, out in enumerate((48, 16, 16))]
    for layer in layers:
        layer.quantize(method)
    packed, x = PackedWeight(layers, "panels"), torch.randn(5, 40, generator=generator)

    def expected() -> torch.Tensor:
        return torch.cat([F.linear(x.double(), layer.weight.double()
                                   * layer.weight_scale.double()[:, None],
                                   None if layer.bias is None else layer.bias.double())
                          for layer in layers], dim=-1)

    torch.testing.assert_close(packed(x).double(), expected(), rtol=1e-6, atol=1e-5)
    codes, scale = quantization.quantize(torch.randn(16, 40, generator=generator), method)
    with torch.no_grad():
        layers[2].weight.copy_(codes)
        layers[2].weight_scale.copy_(scale)
    torch.testing.assert_close(packed(x).double(), expected(), rtol=1e-6, atol=1e-5)
    with pytest.raises(TypeError, match="through the panels only"):
        PackedWeight(layers, "onednn")(x)


@pytest.mark.skipif(not cpu_build.available(), reason="no C compiler")
def test_the_panel_kernel_reads_rows_a_stride_apart():
    generator = torch.Generator().manual_seed(0)
    weight, wide = torch.randn(32, 24, generator=generator), torch.randn(3, 40, generator=generator)
    x = wide[:, 8:32]  # rows 40 elements apart
    out = cpu_linear.panel_linear(x, cpu_linear.panel_layout(weight), 32, None)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ONEDNN)
def test_the_panels_round_less_than_onednn_over_a_long_input(layout):
    # One rounding chain of `in` additions per output (oneDNN's) against blocks of 64.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 2048, generator=generator)
    x = torch.randn(4, 2048, generator=generator)
    packed = PackedWeight([linear_layer(weight, None)])
    exact = F.linear(x.double(), weight.double())
    panels = packed(x)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed.weight, None, "none", [], "")
    assert packed.panels is not None
    assert (panels - exact).abs().mean() < 0.75 * (onednn - exact).abs().mean()


@pytest.mark.parametrize("layout", ONEDNN)
@pytest.mark.parametrize("rows", [1, cpu_linear.PANEL_ROWS, cpu_linear.PANEL_ROWS + 1, 64])
def test_a_packed_weight_multiplies_a_few_float32_rows_through_the_panels(rows, layout,
                                                                         monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_linear, "panel_linear",
                        lambda *args: calls.append(args) or F.linear(args[0], weight))
    weight = torch.randn(32, 16)
    PackedWeight([linear_layer(weight, None)])(torch.randn(rows, 16))
    assert len(calls) == (rows <= cpu_linear.PANEL_ROWS)


@pytest.mark.parametrize("layout", PANELS)
@pytest.mark.parametrize("rows", [1, 64, 700])  # 700 rows of 576: more than one tile of rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_panels_layout_multiplies_every_row_count_through_the_panels(rows, layout, dtype):
    generator = torch.Generator().manual_seed(rows)
    weight, b = torch.randn(40, 576, generator=generator), torch.randn(40, generator=generator)
    layer = linear_layer(weight, b).to(dtype)
    packed = PackedWeight([layer], layout)
    x = torch.randn(rows, 2, 576, generator=generator)[:, 1].to(dtype)  # rows a stride apart
    out = packed(x)
    assert packed.weight is None and out.dtype == dtype  # no oneDNN copy beside the panels
    expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert relative_error(out, expected) < TOLERANCE[dtype]
    batched = packed(x.reshape(rows, 1, 576).expand(rows, 3, 576))  # leading dimensions
    assert batched.shape == (rows, 3, 40) and torch.equal(batched[:, 2], out)


@pytest.mark.parametrize("layout", PANELS)
def test_the_panels_refuse_other_dtypes_with_the_layout_to_use(layout):
    layer = linear_layer(torch.randn(8, 16), None)
    with pytest.raises(TypeError, match="float32 inputs, not torch.bfloat16"):
        PackedWeight([layer], layout)(torch.randn(2, 16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="plain F.linear"):
        PackedWeight([layer.to(torch.float16)], layout)(torch.randn(2, 16).half())


@pytest.mark.parametrize("layout", COPIES)
@pytest.mark.parametrize("rows", [8, 32])  # "onednn": the panels, then oneDNN's copy
def test_packed_copy_follows_in_place_writes_and_new_storage(layout, rows):
    layers = [nn.Linear(16, 32, bias=False), nn.Linear(16, 8)]
    packed, x = PackedWeight(layers, layout), torch.randn(rows, 16)

    def expected() -> torch.Tensor:
        return torch.cat([F.linear(x, layer.weight, layer.bias) for layer in layers], dim=-1)

    with torch.no_grad():
        packed(x)
        layers[0].weight.copy_(torch.randn(32, 16))  # a weight update's in-place copy
        torch.testing.assert_close(packed(x), expected())
        layers[1].bias.add_(1.0)  # a bias alone changes too
        torch.testing.assert_close(packed(x), expected())
        layers[1].weight.data = torch.randn(8, 16)  # new storage
        torch.testing.assert_close(packed(x), expected())


def test_the_fastest_layout_is_the_least_time_relative_to_the_best_at_each_row_count(
        monkeypatch):
    assert cpu_linear.CALIBRATION_ROWS == (1, 8, 64)
    # "transposed" is best at 1 and 8 rows, "onednn" at 64 by less.
    seconds = {(None, 1): 3.0, (None, 8): 6.0, (None, 64): 9.0,
               ("transposed", 1): 1.0, ("transposed", 8): 3.0, ("transposed", 64): 5.0,
               ("onednn", 1): 2.5, ("onednn", 8): 3.3, ("onednn", 64): 4.0}
    monkeypatch.setattr(cpu_linear, "_pass_seconds",
                        lambda groups, layout, rows: seconds[layout, rows])
    monkeypatch.setattr(cpu_linear, "candidate_layouts",
                        lambda dtype: [None, "transposed", "onednn"])
    assert cpu_linear.fastest_layout([[nn.Linear(4, 4)]], torch.float32) == "transposed"
    # relative: 1.05 (2.5 + 1 + 1) against "transposed"'s 1 + 1 + 2.83
    seconds["onednn", 8], seconds["onednn", 64], seconds["transposed", 64] = 3.0, 1.8, 5.1
    assert cpu_linear.fastest_layout([[nn.Linear(4, 4)]], torch.float32) == "onednn"
    for rows in cpu_linear.CALIBRATION_ROWS:
        seconds["transposed", rows] = 10.0
    seconds[None, 1], seconds[None, 8], seconds[None, 64] = 2.55, 3.06, 1.836  # 2% slower:
    assert cpu_linear.fastest_layout([[nn.Linear(4, 4)]], torch.float32) is None  # no copy
    monkeypatch.setattr(cpu_linear, "candidate_layouts", lambda dtype: [None, "panels"])
    for rows, onednn in zip(cpu_linear.CALIBRATION_ROWS, (2.5, 3.0, 1.8), strict=True):
        seconds["panels", rows] = onednn  # the panels are a copy too: the same margin
    assert cpu_linear.fastest_layout([[nn.Linear(4, 4)]], torch.float32) is None
    monkeypatch.setattr(cpu_linear, "candidate_layouts", lambda dtype: [None, "transposed"])
    seconds["transposed", 1], seconds["transposed", 8], seconds["transposed", 64] = 1, 3, 5
    seconds[None, 1], seconds[None, 8], seconds[None, 64] = 1.02, 3.06, 5.1
    assert cpu_linear.fastest_layout([[nn.Linear(4, 4)]], torch.float32) == "transposed"


def test_a_layout_far_faster_at_a_few_rows_wins_over_a_tie_at_one_and_many(monkeypatch):
    # An AVX2 EPYC: oneDNN ties F.linear at 1 and 64 rows (within its copy's margin) but
    # is 1.8x faster at 8, a server's decode step of a few streams.
    seconds = {(None, 1): 1.0, (None, 8): 1.8, (None, 64): 1.0,
               ("onednn", 1): 0.98, ("onednn", 8): 1.0, ("onednn", 64): 0.98}
    monkeypatch.setattr(cpu_linear, "_pass_seconds",
                        lambda groups, layout, rows: seconds[layout, rows])
    monkeypatch.setattr(cpu_linear, "candidate_layouts", lambda dtype: [None, "onednn"])
    assert cpu_linear.fastest_layout([[nn.Linear(4, 4)]], torch.float32) == "onednn"


def test_a_layout_chosen_once_is_remembered_for_the_same_machine_and_shapes(monkeypatch,
                                                                            tmp_path):
    timed = []
    monkeypatch.setattr(cpu_linear, "_timed_choice",
                        lambda groups, dtype: timed.append(dtype) or "transposed")
    remembered = tmp_path / "layouts.json"
    layers = [[nn.Linear(4, 8)]]
    for _ in range(2):
        assert cpu_linear.fastest_layout(layers, torch.float32, remembered) == "transposed"
    assert timed == [torch.float32]  # the second engine read the first one's choice
    cpu_linear.fastest_layout(layers, torch.bfloat16, remembered)
    cpu_linear.fastest_layout([[nn.Linear(4, 16)]], torch.float32, remembered)
    assert len(timed) == 3 and len(json.loads(remembered.read_text())) == 3
    remembered.write_text("{torn")  # a crash mid-write elsewhere: time again, then rewrite
    assert cpu_linear.fastest_layout(layers, torch.float32, remembered) == "transposed"
    assert len(timed) == 4 and len(json.loads(remembered.read_text())) == 1


def test_a_new_candidate_or_changed_kernels_are_timed_anew(monkeypatch, tmp_path):
    # A choice among the old candidates (made before the panels took bfloat16) must not
    # shadow a layout added since, nor a choice timed on other kernel code.
    timed = []
    monkeypatch.setattr(cpu_linear, "_timed_choice",
                        lambda groups, dtype: timed.append(dtype) or None)
    remembered, layers = tmp_path / "layouts.json", [[nn.Linear(4, 8)]]
    monkeypatch.setattr(cpu_linear, "candidate_layouts", lambda dtype: [None, "transposed"])
    monkeypatch.setattr(cpu_build, "library_key", lambda: "kernels-1")
    cpu_linear.fastest_layout(layers, torch.float32, remembered)
    cpu_linear.fastest_layout(layers, torch.float32, remembered)
    monkeypatch.setattr(cpu_linear, "candidate_layouts",
                        lambda dtype: [None, "transposed", "panels"])
    cpu_linear.fastest_layout(layers, torch.float32, remembered)
    monkeypatch.setattr(cpu_build, "library_key", lambda: "kernels-2")
    cpu_linear.fastest_layout(layers, torch.float32, remembered)
    assert len(timed) == 3


def test_the_engine_times_the_layouts_on_its_own_layers(llama_dir):
    llm = LLM(str(llama_dir), exact_logprobs=False)
    model = llm.engine.runner.model
    assert model.linear_layout in cpu_linear.candidate_layouts(torch.float32)
    assert len(packed_weights(llm)) == (4 * model.config.num_hidden_layers + 1  # + LM head
                                        if model.linear_layout in cpu_linear.COPIES else 0)


def test_an_exact_engine_takes_the_panels_untimed(llama_dir, monkeypatch):
    # Exact log-probs: the same seed gives the same bits whatever a timing would choose.
    monkeypatch.setattr(cpu_linear, "fastest_layout", lambda *a, **k: pytest.fail("timed"))
    llm = LLM(str(llama_dir))
    assert llm.engine.runner.exact_logprobs and llm.engine.runner.model.linear_layout == "panels"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_lays_out_its_weights_and_an_update_reaches_them(llama_dir, tmp_path, layout):
    llm = LLM(str(llama_dir))
    model = llm.engine.runner.model
    model.pack_linear_weights(layout)
    before = completions(llm)
    assert model.lm_head.weight.is_contiguous()  # tied to the embedding: never re-stored
    assert (model.lm_head.packed is not None) == (layout in cpu_linear.COPIES)
    packed = packed_weights(llm)  # per layer: q/k/v as one, o, gate/up as one, down; the head
    projections = [m.weight for m in model.modules()
                   if isinstance(m, nn.Linear) and m is not model.lm_head]
    if layout in cpu_linear.COPIES:
        assert len(packed) == 4 * model.config.num_hidden_layers + 1
        assert {len(p.layers) for p in packed} == {1, 2, 3}
        assert all(p.key is not None for p in packed)
    else:  # the parameters themselves, column-major: nothing to rebuild
        assert packed == [] and all(w.t().is_contiguous() for w in projections)
    keys = [p.key for p in packed]
    trainer = trainer_model(llama_dir, seed=3)
    llm.update_weights(trainer.state_dict().items())
    after = completions(llm)
    assert after != before
    assert all(p.key != key for p, key in zip(packed, keys, strict=True))
    assert after == fresh_completions(trainer, llama_dir, tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(
    torch.bfloat16, marks=pytest.mark.skipif(not cpu_linear.packs(torch.bfloat16),
                                             reason="this CPU's oneDNN does not pack bfloat16"))])
def test_the_packed_lm_head_is_refreshed_by_an_update(llama_dir, dtype):
    llm = LLM(str(llama_dir), dtype=dtype)
    model = llm.engine.runner.model
    model.pack_linear_weights("onednn")
    head = model.lm_head
    hidden = torch.randn(5, head.in_features, generator=torch.Generator().manual_seed(2))
    hidden = hidden.to(dtype)
    assert head.packed is not None
    before = head(hidden).double()
    trainer = trainer_model(llama_dir, seed=5)
    llm.update_weights(trainer.state_dict().items())
    expected = F.linear(hidden.double(), trainer.lm_head.weight.detach().double())
    scale = expected.abs().max()
    assert (head(hidden).double() - expected).abs().max() < 0.02 * scale
    assert (before - expected).abs().max() > 0.2 * scale  # the old weights would be caught


@pytest.mark.parametrize("layout", LAYOUTS)
def test_alias_serves_unpacked_weights_that_change_in_place(llama_dir, layout):
    llm, reference = (LLM(str(llama_dir), exact_logprobs=False) for _ in range(2))
    llm.engine.runner.model.pack_linear_weights(layout)
    completions(llm)
    trainer = trainer_model(llama_dir, seed=4)
    llm.update_weights(trainer.state_dict().items(), alias=True)
    assert packed_weights(llm) == [] and llm.engine.runner.model.linear_layout is None
    with torch.no_grad():
        for param in trainer.parameters():
            param.mul_(1.1)  # no new commit: an aliased engine serves this as it is
    reference.update_weights(trainer.state_dict().items())
    assert completions(llm) == completions(reference)


@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8]))
@settings(max_examples=40, deadline=None)
def test_panels_of_stacked_pieces_written_over_old_panels_are_the_plain_layout(sizes, dtype):
    # The reference: the stacked weight padded with zero rows to whole panels, each panel
    # input-major. Written over the panels of other weights (an update's re-layout), no
    # stale row survives, the padding included.
    generator = torch.Generator().manual_seed(sum(sizes))
    pieces = [torch.randn(n, 12, generator=generator).mul(9).to(dtype) for n in sizes]
    stacked = torch.cat(pieces)
    padded = torch.cat([stacked, stacked.new_zeros(-len(stacked) % cpu_linear.PANEL, 12)])
    expected = padded.view(-1, cpu_linear.PANEL, 12).transpose(1, 2)
    assert torch.equal(cpu_linear.panel_layout(pieces), expected)
    old = cpu_linear.panel_layout(torch.full_like(padded, 7))
    written = cpu_linear.panel_layout(pieces, old)
    assert written.data_ptr() == old.data_ptr() and torch.equal(written, expected)
