"""The weight spec's slots: a parameter assembled from its Hugging Face tensors gives each of
them back through its view, for packed parts and stacked entries alike."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.rollout.worker.models.weight_spec import WeightTarget, assemble, views


@settings(max_examples=60, deadline=None)
@given(experts=st.integers(0, 4), parts=st.integers(1, 3), rows=st.integers(1, 4),
       cols=st.integers(1, 5))
def test_assembling_then_viewing_gives_every_tensor_back(experts, parts, rows, cols):
    generator = torch.Generator().manual_seed(experts * 100 + parts * 10 + rows)
    spec, tensors = {}, {}
    for expert in range(experts or 1):
        for part in range(parts):
            name = f"e{expert}.p{part}.weight"
            slot = ((part, parts),) if not experts else ((expert, None), (part, parts))
            spec[name] = WeightTarget("packed.weight", slot=slot)
            tensors[name] = torch.randn(rows, cols, generator=generator)
    spec["norm.weight"] = WeightTarget("norm.weight")
    tensors["norm.weight"] = torch.randn(cols, generator=generator)
    parameters = assemble(spec, tensors)
    stacked = (experts, parts * rows, cols) if experts else (parts * rows, cols)
    assert parameters["packed.weight"].shape == stacked
    assert all(torch.equal(view, tensors[name])
               for name, view in views(spec, parameters).items())


def test_a_view_writes_through_to_its_parameter():
    parameter = torch.zeros(2, 4, 3)
    view = WeightTarget("p", slot=((1, None), (1, 2))).view(parameter)
    view.copy_(torch.ones(2, 3))
    assert parameter[1, 2:].eq(1).all() and parameter.sum() == 6
