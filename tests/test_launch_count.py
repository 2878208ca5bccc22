"""How many kernels one decode step launches (nanoserve/tools/launch_count.py), counted on the CPU
as a GPU would launch them: aten operators that are neither views nor allocations, and Triton
launches, inside the model runner's forward.

The budgets are today's counts, so a change that adds a launch to the decode path fails here. The
triton path runs fused Llama layers (models/triton_layers.py): 9 launches a layer, 3 a step
outside them (embedding, final norm, LM head); issue 43's goal was ≤ 12 a layer. Controls: an added
operator is counted and a view is not; a layer with one more operator raises the per-layer count
by one and leaves the per-step count alone.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.models.layers import RMSNorm
from nanoserve.tools.launch_count import LaunchCounter, per_layer

# (per layer, per step outside the layers) of a steady decode step, batch 1
BUDGETS = {"triton": (9, 3), "torch": (40, 13)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("launches")


def test_the_counter_counts_operators_and_launches_not_views_or_allocations():
    x = torch.randn(4, 8)
    with torch.inference_mode():  # what the model runner's forward reads
        ids = torch.arange(6)
    with LaunchCounter() as counter:
        y = x.view(8, 4).t()  # views: nothing
        z = torch.empty_like(y)  # an allocation: nothing
        z.copy_(y)
        (z * 2).sum()
        x.float()  # already float: no copy
        ids.to(torch.int32)  # a conversion of an inference tensor: one copy
        x.to(torch.float16)  # and of a plain one: one copy, not two
    assert dict(counter.aten) == {"copy_": 1, "mul": 1, "sum": 1, "_to_copy": 2}
    assert counter.total() == 5


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_decode_step_launches_no_more_than_its_budget(workdir, backend):
    layer, fixed = per_layer(workdir, backend)
    budget_layer, budget_fixed = BUDGETS[backend]
    assert sum(layer.values()) <= budget_layer, sorted(layer.items())
    assert sum(fixed.values()) <= budget_fixed, sorted(fixed.items())
    if backend == "triton":
        # RoPE fused with the K/V store, paged decode; each norm with its residual add, one kernel
        assert layer["_rotary_kernel"] == 1 and layer["_paged_decode_kernel"] == 1
        assert layer["_rms_norm_kernel"] == 2 and fixed["_rms_norm_kernel"] == 1
        # q, k, v in one GEMM, gate and up in another; silu·mul one kernel
        assert layer["_linear_pointwise"] == 4 and layer["_silu_and_mul_kernel"] == 1


def test_one_more_operator_in_each_layer_is_counted_once_per_layer(workdir, monkeypatch):
    plain_layer, plain_fixed = per_layer(workdir, "torch")
    forward = RMSNorm.forward

    def with_one_more(self, x):
        return forward(self, x).clone()

    monkeypatch.setattr(RMSNorm, "forward", with_one_more)
    layer, fixed = per_layer(workdir, "torch")
    # two norms a layer, one after the layers
    assert sum(layer.values()) == sum(plain_layer.values()) + 2
    assert sum(fixed.values()) == sum(plain_fixed.values()) + 1
    assert layer["clone"] == 2


def test_without_stacked_weights_the_triton_path_launches_four_more(workdir, monkeypatch):
    from nanoserve.models import triton_layers

    fused_layer, fused_fixed = per_layer(workdir, "triton")
    monkeypatch.setattr(triton_layers, "stack_linears", lambda linears: None)
    layer, fixed = per_layer(workdir, "triton")
    # q, k, v: three GEMMs, not one; gate, up, silu, mul: four launches, not two
    assert sum(layer.values()) == sum(fused_layer.values()) + 4
    assert layer["_linear_pointwise"] == 7 and layer["silu"] == layer["mul"] == 1
    assert fixed == fused_fixed
