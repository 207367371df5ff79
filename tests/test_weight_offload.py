"""The weights' releasable region on CPU (a CUDA engine's at load): every parameter, a tied
one once, becomes an aligned view with its value; offloading points them at host copies,
reloading brings them back to the same addresses; an adopted tensor ends the region."""

from __future__ import annotations

import torch
from torch import nn

from tandem.rollout.worker.weight_offload import ALIGNMENT, OffloadableWeights, parameter_offsets

CPU = torch.device("cpu")


def tied_model() -> nn.Sequential:
    """An embedding tied to its head, odd sizes, a bias, and one bfloat16 layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 5), nn.Linear(5, 3), nn.Linear(3, 5),
                          nn.Linear(5, 7, bias=False))
    model[3].weight = model[0].weight
    model[2].to(torch.bfloat16)
    return model


def values(model: nn.Module) -> list[torch.Tensor]:
    return [param.detach().clone() for param in model.parameters()]


def addresses(model: nn.Module) -> list[int]:
    return [param.data_ptr() for param in model.parameters()]


def test_offsets_start_each_parameter_on_an_alignment_boundary():
    sizes = [nn.Parameter(torch.zeros(n)) for n in (1, 64, 65, 1)]  # 4, 256, 260, 4 bytes
    assert parameter_offsets(sizes) == ([0, 256, 512, 1024], 1028)


def test_parameters_become_aligned_views_of_one_region_with_their_values():
    model = tied_model()
    before = values(model)
    weights = OffloadableWeights(model, CPU)
    start = weights.region.tensor.data_ptr()
    assert len(before) == len(weights.device_views) == 5  # the tied weight once
    assert model[3].weight is model[0].weight
    for param, value, offset in zip(model.parameters(), before, weights.offsets):
        assert param.data_ptr() - start == offset and offset % ALIGNMENT == 0
        assert param.dtype == value.dtype and torch.equal(param, value)
    assert weights.holds(model)


def test_reload_brings_the_offloaded_weights_back_to_the_same_addresses():
    model = tied_model()
    weights = OffloadableWeights(model, CPU)
    awake, before = addresses(model), values(model)
    weights.offload(model)
    assert weights.offloaded and weights.holds(model)
    host = weights.host.data_ptr()
    assert all(host <= address < host + weights.host.numel() for address in addresses(model))
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), before))
    with torch.no_grad():  # an update while asleep lands in the host copies
        model[1].weight.mul_(2.0)
    before[1] = before[1] * 2.0
    weights.offload(model)  # already offloaded: nothing happens
    weights.reload(model)
    weights.reload(model)
    assert not weights.offloaded and weights.holds(model)
    assert addresses(model) == awake
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), before))
    weights.offload(model)  # the next sleep reuses the host buffer
    assert weights.host.data_ptr() == host


def test_an_adopted_tensor_ends_the_region_awake_and_asleep():
    for offloaded in (False, True):
        model = tied_model()
        weights = OffloadableWeights(model, CPU)
        if offloaded:
            weights.offload(model)
        model[1].bias.data = torch.ones(3)
        assert not weights.holds(model)
