"""Weight clustering: each output row of a weight matrix keeps a small codebook of 2^b values,
and every weight becomes the b-bit index of its nearest codebook entry (k-means, SqueezeLLM's
non-uniform quantization, Kim et al. 2023).

**What it stores.** A linear layer y = x·Wᵀ (W [N, K], out × in) becomes

    codes     uint8 [N, K]          values 0 .. 2^b − 1
    codebook  fp16  [N, 2^b]        each row's centroids
    Ŵ[i, j] = codebook[i, codes[i, j]]

RTN and GPTQ (rtn.py, gptq.py) put the 2^b levels of a row on an evenly spaced grid; here they go
wherever the row's weights are dense (weights are bell-shaped, so the levels crowd near 0).

**Per row, not per layer.** One codebook per output row, as SqueezeLLM does: rows differ in scale,
and a layer-wide codebook would spend most of its levels on the widest rows. The price is
2^b fp16 values per row, 16·2^b / K bits per weight on top of the b bits of a code: 0.06 at
K = 4096 and b = 4, but a whole 4 bits at K = 64 (stories260K), where per-row codebooks double
the size. `bits_per_weight` counts it; benchmarks compare methods at the bits they really store.

**Lloyd's algorithm** (k-means in one dimension, every row at once): start from the row's
quantiles at (m + ½) / 2^b (deterministic, and already close: each level starts with an equal
share of the weights), then repeat

    assign:  codes[i, j] = argmin_m (W[i, j] − c[i, m])²
    update:  c[i, m] = Σ_{j: codes = m} s_j W[i, j] / Σ_{j: codes = m} s_j

until no code changes. A centroid whose cluster is empty keeps its value. At the end the codebook
is rounded to fp16 (what the layer stores) and the codes are assigned once more against it.

**Sensitivity-weighted** (SqueezeLLM's "sensitivity-based" k-means). The layer's output error for
row i on inputs x_t is Σ_t (Σ_j e_ij x_tj)², e = W − Ŵ; keeping only the diagonal of XᵀX leaves
Σ_j e_ij² · h_j with h_j = Σ_t x_tj², the energy of input column j (the diagonal of GPTQ's Hessian
up to the factor 2/n). So each weight counts with weight s_j = h_j in the update above: columns
that see large activations pull the centroids towards their weights. SqueezeLLM's Fisher
diagonal plays this role there; the activation energy needs only forward passes. With s ≡ 1 the
two are the same algorithm (a test holds that).

`cluster_model` runs the same block-by-block loop as model.py (each block calibrated on the
outputs of the already-clustered blocks before it) and swaps every linear of every block for a
`ClusteredLinear`; the embeddings and the LM head stay dense. The look-up kernel for CUDA is
nanoserve/kernels/lut_gemv.py. Taught in notebooks/19_weight_clustering.ipynb (exercise 22).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import NanoserveError
from .gptq import capture_inputs
from .model import block_groups, block_inputs, decoder_blocks, run_block

ALLOWED_BITS = (2, 3, 4)
CODEBOOK_DTYPE = torch.float16     # what the layer stores, and what bits_per_weight counts
# the assign step builds an [rows, K, 2^b] distance tensor; rows per chunk keep it this small
_ASSIGN_ELEMENTS = 1 << 24
_QUANTILE_ELEMENTS = 1 << 23   # torch.quantile refuses inputs over 2^24 elements


@dataclass(slots=True)
class ClusterConfig:
    """How `cluster_weight` and `cluster_model` run."""

    bits: int = 4               # 2^bits centroids per output row
    weighted: bool = True       # sensitivity-weighted (needs calibration inputs) or plain k-means
    max_iters: int = 50         # Lloyd iterations; stops earlier when no code changes

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in ALLOWED_BITS:
            raise NanoserveError(f"bits={self.bits!r} is not supported for weight clustering; "
                                 f"allowed: {', '.join(map(str, ALLOWED_BITS))} (codes are "
                                 "uint8 indices into 4..16 centroids per row)")
        if not isinstance(self.weighted, bool):
            raise NanoserveError(f"weighted must be True or False, got {self.weighted!r}")
        if isinstance(self.max_iters, bool) or not isinstance(self.max_iters,
                                                              int) or self.max_iters < 1:
            raise NanoserveError(f"max_iters must be a positive int, got {self.max_iters!r}")


@dataclass(slots=True)
class ClusteredWeight:
    """A clustered [N, K] weight: Ŵ[i, j] = codebook[i, codes[i, j]]."""

    codes: torch.Tensor      # N, K     uint8
    codebook: torch.Tensor   # N, 2^b   fp16
    bits: int

    def __post_init__(self):
        if self.codes.dim() != 2 or self.codebook.shape != (self.codes.shape[0], 2 ** self.bits):
            raise NanoserveError(f"inconsistent ClusteredWeight: codes {tuple(self.codes.shape)}, "
                                 f"codebook {tuple(self.codebook.shape)}, bits {self.bits}; need "
                                 f"codes [N, K] and codebook [N, {2 ** self.bits}]")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Ŵ [N, K]: each code looked up in its own row's codebook."""
        return lookup(self.codebook.to(dtype), self.codes)

    def bits_per_weight(self) -> float:
        return bits_per_weight(self.bits, self.codes.shape[1])


def bits_per_weight(bits: int, k: int) -> float:
    """Stored bits per weight of a clustered row of k weights: a b-bit code each, plus 2^b fp16
    centroids shared by the row."""
    return bits + torch.finfo(CODEBOOK_DTYPE).bits * 2 ** bits / k


def lookup(codebook: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Ŵ [N, K] = codebook [N, M] gathered at codes [N, K] along each row."""
    return codebook.gather(1, codes.long())                                    # N, K


# ----------------------------------------------------------------------------- Lloyd's algorithm
def quantile_init(w: torch.Tensor, n_centroids: int) -> torch.Tensor:
    """Each row's quantiles at (m + ½) / n_centroids, m = 0 .. n_centroids − 1: [N, M]."""
    q = (torch.arange(n_centroids, dtype=w.dtype, device=w.device) + 0.5) / n_centroids   # M
    rows = max(1, _QUANTILE_ELEMENTS // max(1, w.shape[1]))  # torch.quantile's input limit
    chunks = [torch.quantile(w[r0:r0 + rows], q, dim=1).T for r0 in range(0, w.shape[0], rows)]
    return torch.cat(chunks).contiguous()                                                  # N, M


def assign(w: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """The index of each weight's nearest centroid in its row (the lowest index on a tie):
    w [N, K], centroids [N, M] → uint8 [N, K]."""
    n, k = w.shape
    rows = max(1, _ASSIGN_ELEMENTS // max(1, k * centroids.shape[1]))
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    for r0 in range(0, n, rows):
        dist = (w[r0:r0 + rows, :, None] - centroids[r0:r0 + rows, None, :]) ** 2   # rows, K, M
        codes[r0:r0 + rows] = dist.argmin(dim=2).to(torch.uint8)
    return codes


def update(w: torch.Tensor, codes: torch.Tensor, centroids: torch.Tensor,
           sensitivity: torch.Tensor | None = None) -> torch.Tensor:
    """Each centroid moved to the (sensitivity-weighted) mean of its weights; a centroid with no
    weights (or zero total weight) keeps its value. w, codes [N, K]; centroids [N, M];
    sensitivity [K] (one per input column) or None (all 1) → [N, M]."""
    s = torch.ones_like(w) if sensitivity is None else sensitivity.to(w.dtype).expand_as(w)  # N, K
    idx = codes.long()                                                                      # N, K
    sums = torch.zeros_like(centroids).scatter_add_(1, idx, s * w)                          # N, M
    mass = torch.zeros_like(centroids).scatter_add_(1, idx, s)                              # N, M
    return torch.where(mass > 0, sums / mass.clamp_min(torch.finfo(w.dtype).tiny), centroids)


def lloyd(w: torch.Tensor, n_centroids: int, sensitivity: torch.Tensor | None = None,
          max_iters: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means of each row of w [N, K] from the quantile init: (codes uint8 [N, K], centroids
    [N, M]) in w's dtype, the codes assigned against the returned centroids."""
    centroids = quantile_init(w, n_centroids)
    codes = assign(w, centroids)
    for _ in range(max_iters):
        centroids = update(w, codes, centroids, sensitivity)
        new_codes = assign(w, centroids)
        if torch.equal(new_codes, codes):
            break
        codes = new_codes
    return codes, centroids


def weighted_error(w: torch.Tensor, w_hat: torch.Tensor,
                   sensitivity: torch.Tensor | None = None) -> float:
    """Σ_ij s_j (W − Ŵ)²_ij: the objective both variants minimize (s ≡ 1 when None)."""
    err = (w.double() - w_hat.double()) ** 2                                               # N, K
    return float(err.sum() if sensitivity is None else (err * sensitivity.double()).sum())


def cluster_weight(weight: torch.Tensor, config: ClusterConfig,
                   sensitivity: torch.Tensor | None = None) -> ClusteredWeight:
    """Cluster one [N, K] weight (k-means per row in float32, or float64 for a float64 weight).
    sensitivity [K]: the activation energy Σ_t x_tj² of each input column; needed when
    config.weighted, refused otherwise (so that a forgotten calibration is not silent)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise NanoserveError(f"weight must be a float [N, K] matrix, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
    k = weight.shape[1]
    if config.weighted and sensitivity is None:
        raise NanoserveError("weighted=True needs the sensitivity of each input column (the "
                             "activation energy Σx² from calibration inputs); pass it, or use "
                             "ClusterConfig(weighted=False)")
    if not config.weighted and sensitivity is not None:
        raise NanoserveError("a sensitivity was given but ClusterConfig(weighted=False) ignores "
                             "it; set weighted=True")
    if sensitivity is not None and (sensitivity.shape != (k,) or bool((sensitivity < 0).any())):
        raise NanoserveError(f"sensitivity must be [{k}] (one per input column) and ≥ 0, got "
                             f"shape {tuple(sensitivity.shape)}")
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.detach().to(dtype)                                                          # N, K
    s = None if sensitivity is None else sensitivity.to(dtype)
    _, centroids = lloyd(w, 2 ** config.bits, s, config.max_iters)
    codebook = centroids.to(CODEBOOK_DTYPE)                                                # N, M
    codes = assign(w, codebook.to(dtype))  # the last assignment is against the stored values
    return ClusteredWeight(codes, codebook, config.bits)


# ----------------------------------------------------------------------------- the layer
class ClusteredLinear(nn.Module):
    """y = x · Ŵᵀ + b with Ŵ[i, j] = codebook[i, codes[i, j]], held as codes and codebook.

    Forward: on CUDA with at most LUT_MAX_ROWS rows, the look-up GEMV kernel
    (nanoserve/kernels/lut_gemv.py: Ŵ is never written to memory); everywhere else the torch
    reference, gather then matmul (Ŵ is built in float for every call)."""

    LUT_MAX_ROWS = 16

    def __init__(self, in_features: int, out_features: int, bits: int, bias: bool,
                 dtype: torch.dtype = CODEBOOK_DTYPE, device: torch.device | str = "cpu"):
        super().__init__()
        ClusterConfig(bits=bits)  # validates bits
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        kw = dict(device=device)
        self.register_buffer("codes", torch.zeros(out_features, in_features, dtype=torch.uint8,
                                                  **kw))
        self.register_buffer("codebook", torch.zeros(out_features, 2 ** bits, dtype=dtype, **kw))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, **kw) if bias else None)

    @classmethod
    def from_clustered(cls, cw: ClusteredWeight, bias: torch.Tensor | None = None) -> \
            ClusteredLinear:
        n, k = cw.codes.shape
        layer = cls(k, n, cw.bits, bias is not None, cw.codebook.dtype, cw.codes.device)
        layer.codes.copy_(cw.codes)
        layer.codebook.copy_(cw.codebook)
        if bias is not None:
            layer.bias.copy_(bias.detach().to(cw.codebook.dtype))
        return layer

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return lookup(self.codebook.to(dtype), self.codes)                                # N, K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)                                              # M, K
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if x.is_cuda and x2.shape[0] <= self.LUT_MAX_ROWS:
            from ..kernels.lut_gemv import lut_gemv

            y = lut_gemv(x2, self.codes, self.codebook)                                   # M, N
            y = y if bias is None else y + bias
        else:
            y = F.linear(x2, self.dequantize(x.dtype), bias)                              # M, N
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, codebook={self.codebook.dtype}")


# ----------------------------------------------------------------------------- the model
@dataclass
class ClusterResult:
    config: ClusterConfig
    weights: dict[str, ClusteredWeight]     # full module name → codes and codebook

    def bits_per_weight(self) -> float:
        """Stored bits over all clustered weights (codes + codebooks), per weight."""
        total = sum(cw.codes.numel() * cw.bits_per_weight() for cw in self.weights.values())
        return total / sum(cw.codes.numel() for cw in self.weights.values())


@torch.no_grad()
def cluster_model(model: nn.Module, calib: torch.Tensor | None, config: ClusterConfig,
                  batch_size: int = 8) -> ClusterResult:
    """Swap every linear of every decoder block for a ClusteredLinear, block by block; the
    embeddings and the LM head stay dense.

    calib: token ids [n_samples, seqlen], needed when config.weighted: each linear's sensitivity
    is the energy Σx² of its input columns over the calibration tokens, measured while the blocks
    before it are already clustered (the inputs it will really see, as model.py does for GPTQ).
    """
    if config.weighted and calib is None:
        raise NanoserveError("weighted clustering needs calibration text: pass token ids "
                             "[n_samples, seqlen], or use ClusterConfig(weighted=False)")
    prefix, blocks = decoder_blocks(model)
    device = next(model.parameters()).device
    inputs = None
    if config.weighted:
        inputs = block_inputs(model, blocks[0], calib.to(device), batch_size)
    result = ClusterResult(config, {})
    for i, block in enumerate(blocks):
        for _prev, names in block_groups(model, block):
            linears = {n: block.get_submodule(n) for n in names}
            energy = _input_energy(block, linears, inputs) if config.weighted else {}
            for n, lin in linears.items():
                if not isinstance(lin, nn.Linear):
                    raise NanoserveError(f"{prefix}.{i}.{n} is a {type(lin).__name__}, not an "
                                         "nn.Linear: cluster a float model")
                cw = cluster_weight(lin.weight, config, energy.get(n))
                _replace(block, n, ClusteredLinear.from_clustered(cw, lin.bias).to(device))
                result.weights[f"{prefix}.{i}.{n}"] = cw
        if inputs is not None:
            inputs = [(out, *args[1:]) for out, args in zip(run_block(block, inputs), inputs)]
    return result


def _input_energy(block: nn.Module, linears: dict[str, nn.Module],
                  inputs: list[tuple]) -> dict[str, torch.Tensor]:
    """Σ_t x_tj² over every calibration token, per input column of each linear: {name: [K]}."""
    energy = {n: torch.zeros(lin.in_features, dtype=torch.float64) for n, lin in linears.items()}

    def add(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()                                            # T, K
        energy[name] += (x * x).sum(0).cpu()

    with capture_inputs(linears, add):
        run_block(block, inputs)
    return energy


def _replace(block: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(block.get_submodule(parent_name) if parent_name else block, child, layer)
