"""Exercise 19: tensor parallelism (nanoserve/parallel/tensor_parallel.py: ColumnParallelLinear,
RowParallelLinear).

Run in 2 gloo processes, as the real thing: an MLP y = W₂ᵀ·GELU(W₁ᵀx + b₁) + b₂ whose first layer is
split by columns (each rank its half of the hidden units) and whose second is split by rows (each
rank the matching half of its inputs, the partial products summed by the all-reduce). The oracle is
outside the classes: the same two nn.Linear layers, whole, in one process. Also each class alone: a
column-parallel layer gives its rank's slice of the whole layer's outputs. Known-wrong variants at
the end: the all-reduce left out, the bias added on every rank, and the weight split along the wrong
axis.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from explain import expect, expect_close, explained_failure
from torch import nn

REFERENCE = "nanoserve.parallel.tensor_parallel"
EXERCISE = "tensor_parallel"
pytestmark = pytest.mark.ex19

IN, HIDDEN, OUT, WORLD = 24, 40, 16, 2


def _layers():
    g = torch.Generator().manual_seed(0)
    fc1, fc2 = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
    with torch.no_grad():
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    return fc1, fc2, torch.randn(5, IN, generator=g)


def _load(name: str, file: str | None):
    """The module under test, in a spawned rank: nanoserve's by name, the learner's from its
    file."""
    if file is None or name.startswith("nanoserve"):
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank, world, name, file, variant, out):
    """One of the WORLD ranks (launch.spawn_ranks owns the gloo group and its 120 s timeout)."""
    impl = WRONG[variant][0] if variant else _load(name, file)
    fc1, fc2, x = _layers()
    cols = torch.arange(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
    try:
        col, row = impl.ColumnParallelLinear(fc1, cols), impl.RowParallelLinear(fc2, cols)
        with torch.no_grad():
            mine = col(x)  # 5, HIDDEN/2
            y = row(F.gelu(mine))  # 5, OUT
        res = {"mine": mine.tolist(), "y": y.tolist(),
               "shapes": [col.out_features, row.in_features]}
    except NotImplementedError as e:
        res = {"not_implemented": str(e)}
    except Exception as e:  # a shape error, say: reported as a failed check, with its message
        res = {"error": f"{type(e).__name__}: {e}"}
    if rank == 0:
        Path(out).write_text(json.dumps(res))


def _run(impl, variant: str | None = None) -> dict:
    from nanoserve.parallel.launch import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        name, file = getattr(impl, "__name__", REFERENCE), getattr(impl, "__file__", None)
        spawn_ranks(_rank, WORLD, name, file, variant, out)
        res = json.loads(Path(out).read_text())
    if "not_implemented" in res:
        raise NotImplementedError(res["not_implemented"])
    expect("error" not in res, "the layers on rank 0 of 2 gloo processes", "no exception",
           res.get("error"))
    return res


def check_column(impl, variant=None):
    fc1, _, x = _layers()
    res = _run(impl, variant)
    with torch.no_grad():
        want = fc1(x)[:, : HIDDEN // WORLD]  # rank 0's half of the hidden units
    case = (f"ColumnParallelLinear(nn.Linear({IN}, {HIDDEN}), index 0..{HIDDEN // WORLD - 1}) on "
            "rank 0 of 2")
    expect(res["shapes"][0] == HIDDEN // WORLD, f"{case}: out_features", HIDDEN // WORLD,
           res["shapes"][0])
    expect_close(torch.tensor(res["mine"]), want, f"{case}: its outputs against the whole "
                 "layer's first half", atol=1e-5, rtol=1e-5, dims="token, unit")


def check_mlp(impl, variant=None):
    fc1, fc2, x = _layers()
    res = _run(impl, variant)
    with torch.no_grad():
        want = fc2(F.gelu(fc1(x)))  # the whole MLP in one process
    case = (f"an MLP {IN} -> {HIDDEN} -> {OUT} split column-then-row over 2 gloo processes, "
            "rank 0's output")
    expect(res["shapes"][1] == HIDDEN // WORLD, f"{case}: RowParallelLinear's in_features",
           HIDDEN // WORLD, res["shapes"][1])
    expect_close(torch.tensor(res["y"]), want, f"{case} against the whole MLP in one process",
                 atol=1e-4, rtol=1e-5, dims="token, out")


def test_ex19_1_column_parallel(impl):
    check_column(impl)


def test_ex19_2_row_parallel_mlp(impl):
    check_mlp(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _reference():
    return importlib.import_module(REFERENCE)


class _NoAllReduce(nn.Module):
    def __init__(self, layer, index):
        super().__init__()
        self.inner = _reference().RowParallelLinear(layer, index)
        self.in_features = self.inner.in_features

    def forward(self, x):
        return F.linear(x, self.inner.weight, self.inner.bias)


class _BiasEverywhere(_NoAllReduce):
    def forward(self, x):
        y = F.linear(x, self.inner.weight, self.inner.bias)
        dist.all_reduce(y)
        return y


class _WrongAxis(nn.Module):  # column split along the inputs: takes columns of W, not rows
    def __init__(self, layer, index):
        super().__init__()
        self.weight = layer.weight.detach()[:, : len(index)].clone()
        self.out_features = len(index)

    def forward(self, x):
        return x[..., : self.weight.shape[1]] @ self.weight.t()


def _variant(**kw):
    ref = _reference()
    return type("Variant", (), {"ColumnParallelLinear": ref.ColumnParallelLinear,
                                "RowParallelLinear": ref.RowParallelLinear, **kw})


WRONG = {
    "the all-reduce left out": (_variant(RowParallelLinear=_NoAllReduce), check_mlp),
    "the bias added on every rank": (_variant(RowParallelLinear=_BiasEverywhere), check_mlp),
    "the weight split along its inputs": (_variant(ColumnParallelLinear=_WrongAxis), check_column),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex19_known_wrong_variants_fail_and_say_why(name):
    explained_failure(WRONG[name][1], None, name)
