"""The CPU GEMM: linear layers through oneDNN instead of torch's default BLAS call.

On a CPU nearly all of a step's arithmetic is the linear layers and the LM head. `nn.Linear`
on CPU calls the BLAS library torch was built with (Intel's MKL in the PyPI wheels); on the
AMD EPYC this project is measured on, oneDNN (also inside torch, the library behind its CPU
convolutions) runs the same fp32 GEMMs at about twice MKL's rate, more on the LM head
(benchmarks/RESULTS.md, "Where the time goes"). vLLM's CPU backend calls oneDNN for the same
reason.

    OneDNNLinear        an nn.Linear (same parameters, same state dict) whose forward calls
                        oneDNN's fp32/bf16 matmul, through the op torch's own compiler uses,
                        on a copy of the weight prepacked in oneDNN's blocked layout
    use_onednn_linears  swaps a CPU model's plain nn.Linear layers for it, after checking once
                        that the op exists and agrees with F.linear; says why not otherwise

Prepacking. Given a plain [out, in] weight, oneDNN reorders it into its blocked layout inside every
call; `_reorder_linear_weight` does it once (vLLM's CPU linears do the same). It pays most where a
step is a few rows over big weights, the LM head above all, where the reorder costs as much as
the product (benchmarks/RESULTS.md, "Third step"). The layout is chosen for a batch hint
(PACK_ROWS); measured, a hint of 16 or more serves 1..256 rows alike, and 1 does not help. The
cost: a second copy of every linear's weight (the plain Parameter stays, for the state dict, tied
embeddings, LoRA merges and quantization). The copy is remade when the weight changes in place
(keyed by its storage and autograd version counter, which copy_ bumps).

GELU as a post-op. `forward_gelu` asks oneDNN for act(x @ Wᵀ + b) in one call: the GELU is applied
to each output as the GEMM writes it, instead of a second pass over the [rows, 4C] activations,
which pays once a step has a few dozen rows (float32; benchmarks/RESULTS.md, "Fourth step"); the
difference from F.gelu after F.linear is ~2e-7. Float32 only: in bfloat16 the
fused GELU acts on the float32 sum before rounding, where HF rounds first (~1e-2 apart).

A few rows: MKL, on Intel processors. A decode step with one sequence multiplies one row by each
weight. On an Intel Xeon, oneDNN's fixed cost per call and its reading speed on small weights lose
to MKL's GEMV on layers of a few MB, at 1 to 3 rows; at 4 rows MKL switches to its GEMM and
oneDNN is faster again. On the LM heads (50257 × 384, 32000 × 512, 151936 ×
896: tall and narrow) oneDNN reads faster at any row count. On an AMD EPYC the same measurement
favours oneDNN almost everywhere, most of all at 2 and 3 rows (RESULTS.md has the figures; MKL picks
its code paths by the processor's vendor, and its fastest ones are Intel's). So the rule is the
vendor's: on a GenuineIntel processor a float32 weight under GEMV_MAX_BYTES calls F.linear for up to
GEMV_MAX_ROWS = 3 rows; elsewhere GEMV_MAX_ROWS = 0 and every shape goes to oneDNN (`gemv_max_rows`;
benchmarks/bench_cpu_linear.py, cpu_linear*.json; RESULTS.md, "Fifth step" and "MKL on an AMD
EPYC"). A vendor, not a timing taken at start-up: the route decides how a product rounds, and a
model should give the same tokens in every run on one machine. bfloat16 (MKL has no bf16 GEMV) keeps
oneDNN. The 32 MB line sits between the layers and the heads measured; on larger layers (Llama's
4096 × 4096) the two measured alike on the Xeon.

The math is the same fp32 (or bf16) GEMM with fp32 accumulation: results differ from MKL's
only in summation order, ~1e-6 (tests/test_cpu_step_costs.py checks it against a float64 reference,
beside F.linear's own error). Autograd is not supported by the op, so a forward that needs
gradients takes the plain path.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_DTYPES = (torch.float32, torch.bfloat16)
PACK_ROWS = 64  # the batch hint oneDNN chooses the packed layout for (see above)


def cpu_vendor() -> str:
    """The x86 processor's vendor (/proc/cpuinfo's vendor_id: "GenuineIntel", "AuthenticAMD"), or ""
    where it cannot be read (another OS, another architecture)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("vendor_id"):
            return line.partition(":")[2].strip()
    return ""


def gemv_max_rows(vendor: str) -> int:
    """How many rows go to MKL's GEMV (F.linear), not oneDNN, on this vendor's processors
    (above)."""
    return 3 if vendor == "GenuineIntel" else 0


GEMV_MAX_BYTES = 32 << 20  # a float32 weight under 32 MB ...
GEMV_MAX_ROWS = gemv_max_rows(cpu_vendor())  # ... with up to this many rows: MKL (see above)
# HF's activation name -> oneDNN's GELU algorithm
GELU_POST_OPS = {"gelu": "none", "gelu_python": "none",
                 "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_python_tanh": "tanh",
                 "gelu_fast": "tanh"}


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]ᵀ + bias [out] -> [..., out], by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       approximate: str) -> torch.Tensor:
    """GELU(x @ weightᵀ + bias) by oneDNN, the GELU as a post-op ("none" or "tanh", as F.gelu)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], approximate)


def blas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The same product by torch's own CPU path (F.linear: the BLAS torch was built with, MKL in the
    PyPI wheels). OneDNNLinear's few-rows route calls it by this name, so a test can see which
    library a shape took."""
    return F.linear(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """nn.Linear computed by oneDNN (built by `from_linear`, sharing the layer's parameters)."""

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> OneDNNLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = layer.in_features, layer.out_features
        # the same Parameters: tied weights stay tied
        new.weight, new.bias = layer.weight, layer.bias
        new._packed, new._packed_key = None, None
        return new

    def gemv(self, x: torch.Tensor) -> bool:
        """Whether x holds so few rows that MKL (F.linear) computes them faster than oneDNN (see
        above)."""
        w = self.weight
        return (x.numel() <= GEMV_MAX_ROWS * self.in_features and w.dtype == torch.float32
                and w.numel() * 4 < GEMV_MAX_BYTES)

    def packed_weight(self) -> torch.Tensor:
        """The weight in oneDNN's blocked layout (an opaque mkldnn tensor), remade when it
        changed."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype)
        if self._packed_key != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)
            self._packed_key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)  # the op has no backward
        if self.gemv(x):
            return blas_linear(x, self.weight, self.bias)
        return onednn_linear(x, self.packed_weight(), self.bias)

    def fuses_gelu(self, hidden_act: str) -> bool:
        """Whether `forward_gelu` can stand for ACTIVATION_FNS[hidden_act](self(x)) (float32, a
        GELU)."""
        return hidden_act in GELU_POST_OPS and self.weight.dtype == torch.float32

    def forward_gelu(self, x: torch.Tensor, hidden_act: str) -> torch.Tensor:
        """GELU(x @ Wᵀ + b) in one oneDNN call (a post-op; see above; a few rows: F.linear, then
        F.gelu). Only where `fuses_gelu`."""
        approximate = GELU_POST_OPS[hidden_act]
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.gelu(F.linear(x, self.weight, self.bias), approximate=approximate)
        if self.gemv(x):
            return F.gelu(blas_linear(x, self.weight, self.bias), approximate=approximate)
        return onednn_linear_gelu(x, self.packed_weight(), self.bias, approximate)


def onednn_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot serve this model's linears, or None when it can."""
    if device.type != "cpu":
        return f"device {device.type} (oneDNN serves CPU models)"
    if dtype not in _DTYPES:
        return f"dtype {dtype} (oneDNN's CPU matmul here: float32, bfloat16)"
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return "this torch build has no oneDNN linear op"
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((3, 40), (24, 40), (24,)))
    try:
        got = onednn_linear(x, w, b)
        packed = onednn_linear(x, torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS), b)
    except (RuntimeError, AttributeError) as e:
        return f"the oneDNN linear op failed: {e}".splitlines()[0]
    for y in (got, packed):
        if not torch.allclose(y.float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2):
            return "the oneDNN linear op disagrees with F.linear"
    return None


def use_onednn_linears(model: nn.Module) -> str | None:
    """Swap every plain nn.Linear of `model` (not subclasses such as quantized layers) for a
    OneDNNLinear over the same parameters. Returns None when done, else why not (nothing
    changed)."""
    p = next(model.parameters())
    why = onednn_unavailable(p.device, p.dtype)
    if why is not None:
        return why
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype in _DTYPES:
                setattr(parent, name, new := OneDNNLinear.from_linear(child))
                new.packed_weight()  # packed now, not in the first request's step
    return None
