"""Sampling: turning next-token logits into a token.

`SamplingParams` (sampling_params.py) holds one request's settings. The pipeline, in the order
vLLM applies it:

    logits ─ logit_bias ─ min_tokens (stop tokens banned)
           ─ repetition / presence / frequency penalties
           ─ /temperature ─ min-p ─ top-k ─ top-p ─ softmax ─ draw (seeded)

`process_logits` is the first line (what greedy takes the argmax of), `probs_from_logits` the
second. Temperature 0 means greedy. Each request with a `seed` draws from its own
`torch.Generator`, so the same seed gives the same tokens whatever else runs beside it; sample
i of n uses seed + i, so seeds live in the signed 64-bit range with room for n.

The sampler cannot turn finite logits into NaN: scaled logits are clamped to float32's finite
range, and min-p, top-k and top-p always keep the most likely token.

There is one sampling path, batched: `sample_batch` draws a token for every row of a step with
one device→host transfer (a GPU pays dearly for one per row), and `probs_from_logits_batch` is
the law it draws from, settings per row. `sample_next` and `probs_from_logits` are the same
functions on a batch of one (speculative decoding verifies against exactly that law). The law
written out for one row, plainly, is tests/sampling_reference.py, the tests' reference (notebook
00's hand-over writes it inline too, for temperature and top-k, and checks this file against it).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from .sampling_params import SamplingParams

__all__ = ["SamplingParams", "apply_repetition_penalty", "apply_penalties", "process_logits",
           "probs_from_logits", "probs_from_logits_batch", "sample_next", "sample_batch",
           "sample_batch_on_device",
           "greedy_argmax", "mask_from", "make_generator"]

_F32 = torch.finfo(torch.float32)
ARGMAX_CHUNK = 512  # greedy_argmax's chunk of the vocabulary


def greedy_argmax(logits: torch.Tensor,
                  chunk: int = ARGMAX_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits.argmax(-1), logits.amax(-1)) for logits [R, V], the same indices, in about one amax's
    time.

    torch's CPU argmax over a long row is several times slower than its amax (measured:
    benchmarks/RESULTS.md, "Fourth step"). So: the maximum of every chunk of `chunk`
    columns ([R, V / chunk], one vectorized pass), the first chunk holding the row's maximum (an
    argmax over ~100 columns), then the argmax inside that chunk alone. The first maximal chunk and
    the first maximum inside it are the row's first maximum: ties and NaN (which argmax and amax
    both treat as the largest) resolve as torch.argmax does. The row maxima come free, for the NaN
    check."""
    R, V = logits.shape
    n = V // chunk
    if n < 2 or logits.device.type != "cpu":  # (a GPU's argmax is as fast as its amax)
        return logits.argmax(-1), logits.amax(-1)
    maxima = logits[:, :n * chunk].unflatten(1, (n, chunk)).amax(-1)  # R, n
    if V > n * chunk:  # the shorter last chunk
        maxima = torch.cat([maxima, logits[:, n * chunk:].amax(-1, keepdim=True)], 1)  # R, n + 1
    start = maxima.argmax(-1) * chunk  # R: where the first chunk holding the maximum starts
    cols = (start[:, None] + torch.arange(chunk, device=logits.device)).clamp(max=V - 1)  # R, chunk
    # (past the end, the clamp repeats column V − 1 after itself: a repeat never comes first)
    return start + logits.gather(1, cols).argmax(-1), maxima.amax(-1)  # R; R


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor,
                             penalty: float) -> torch.Tensor:
    """CTRL's rule: for every token already seen, a positive logit is divided by the penalty and a
    negative one multiplied by it (both make it less likely for penalty > 1). logits [V] or [B,
    V]."""
    if penalty == 1.0 or seen_ids.numel() == 0:
        return logits
    seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    seen[seen_ids.to(logits.device)] = True
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def apply_penalties(logits: torch.Tensor, output_ids: Sequence[int], presence: float,
                    frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: logit[t] − frequency · count(t) − presence ·
    [count(t) > 0], counting the *generated* tokens only. logits [V]."""
    if not output_ids or (presence == 0 and frequency == 0):
        return logits
    V = logits.shape[-1]
    ids = torch.tensor(output_ids, device=logits.device)
    counts = torch.bincount(ids, minlength=V)[:V].to(logits.dtype)  # V
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def process_logits(logits: torch.Tensor, params: SamplingParams,
                   seen_ids: torch.Tensor | None = None,
                   output_ids: Sequence[int] = (), stop_ids: Collection[int] = ()) -> torch.Tensor:
    """The settings that reshape one row's logits [V] before temperature, in vLLM's order:
    logit_bias, min_tokens (the stop tokens get -inf until `output_ids` holds min_tokens), then the
    repetition penalty (over `seen_ids`: prompt + output) and the presence / frequency penalties
    (output only)."""
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype,
                            device=logits.device)
        logits = logits.index_add(0, ids, bias)
    banned = ()
    if len(output_ids) < params.min_tokens:
        banned = sorted(t for t in stop_ids if t < logits.shape[-1])
    if banned:
        logits = logits.index_fill(0, torch.tensor(banned, device=logits.device), float("-inf"))
    if seen_ids is not None:
        logits = apply_repetition_penalty(logits, seen_ids, params.repetition_penalty)
    return apply_penalties(logits, output_ids, params.presence_penalty, params.frequency_penalty)


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0) -> torch.Tensor:
    """The distribution sampled from, with one setting for every row: softmax(logits / T)
    restricted to the min-p, top-k and top-p sets. logits [..., V] -> probs [..., V], float32.

    The batched law (`probs_from_logits_batch`) with the same settings in every row: one law, so
    what speculative decoding verifies against is what the engine draws from."""
    rows = logits.reshape(-1, logits.shape[-1])  # R, V
    R = rows.shape[0]
    probs = probs_from_logits_batch(rows, [temperature] * R, [top_k] * R, [top_p] * R, [min_p] * R)
    return probs.reshape(logits.shape)


def sample_next(logits: torch.Tensor, params: SamplingParams, seen_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None, output_ids: Sequence[int] = (),
                stop_ids: Collection[int] = ()) -> int:
    """One token id from one position's logits [V] (`output_ids`: the tokens generated so far):
    `sample_batch` on a batch of one."""
    tokens, _ = sample_batch(logits[None], [params], [seen_ids], [generator], [output_ids],
                             [stop_ids])
    return tokens[0]


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 seen: list[torch.Tensor | None],
                 generators: list[torch.Generator | None],
                 outputs: list[Sequence[int]] | None = None,
                 stop_ids: list[Collection[int]] | None = None) -> tuple[list[int], list[bool]]:
    """One token for each row of logits [R, V] — row i with params[i], its seen ids (repetition
    penalty), its generated ids and stop ids (min_tokens, presence / frequency penalties) and its
    generator — with one device→host transfer for the whole batch (`sample_next` per row would cost
    one each). Returns the tokens and which rows held a NaN (their token means nothing: the engine
    fails those requests). Each seeded row draws from its own generator, so a row's draws do not
    depend on its neighbours (tests/test_sampling.py holds it to the written-out law)."""
    tokens, nan = sample_batch_on_device(logits, params, seen, generators, outputs, stop_ids)
    host = torch.cat([tokens, nan.long()]).tolist()  # the one sync
    R = len(params)
    return host[:R], [bool(b) for b in host[R:]]


@torch.inference_mode()  # (also faster on CPU: no autograd bookkeeping on the fresh tensors)
def sample_batch_on_device(logits: torch.Tensor, params: list[SamplingParams],
                           seen: list[torch.Tensor | None],
                           generators: list[torch.Generator | None],
                           outputs: list[Sequence[int]] | None = None,
                           stop_ids: list[Collection[int]] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_batch` without the transfer: the tokens [R] and the NaN flags [R] stay on the
    logits' device, read by no one yet (async scheduling feeds them to the next step's forward
    before the host sees them: engine/async_step.py)."""
    outputs = outputs or [()] * len(params)
    stop_ids = stop_ids or [()] * len(params)
    reshaped = [i for i, p in enumerate(params) if p.reshapes_logits]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    # R: which rows hold NaN, on the logits as the model gave them (max propagates NaN: one pass,
    # cheaper than isnan().any()); when every row is greedy and unchanged, greedy_argmax's
    # maxima below give it
    nan = None if len(greedy) == len(params) and not reshaped else logits.amax(-1).isnan()
    if reshaped:
        logits = logits.clone()  # R, V
        for i in reshaped:
            logits[i] = process_logits(logits[i], params[i], seen[i], outputs[i], stop_ids[i])
    if len(greedy) == len(params):  # every row greedy: no copy of the [R, V] logits
        tokens, maxima = greedy_argmax(logits)  # R; R
        if nan is None:
            nan = maxima.isnan()
    else:
        tokens = torch.zeros(len(params), dtype=torch.long, device=logits.device)  # R
    if greedy and len(greedy) < len(params):
        g = torch.tensor(greedy, device=logits.device)
        tokens = tokens.index_copy(0, g, greedy_argmax(logits.index_select(0, g))[0])
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = logits if len(rows) == len(params) else logits[rows]  # S, V
        chosen = [params[i] for i in rows]
        probs = probs_from_logits_batch(sub, [p.temperature for p in chosen],
                                        [p.top_k for p in chosen], [p.top_p for p in chosen],
                                        [p.min_p for p in chosen])  # S, V
        # S × [1]
        drawn = [torch.multinomial(p, 1, generator=generators[i]) for p, i in zip(probs, rows)]
        tokens = tokens.index_copy(0, torch.tensor(rows, device=logits.device), torch.cat(drawn))
    return tokens, nan


def probs_from_logits_batch(logits: torch.Tensor, temperatures: Sequence[float],
                            top_ks: Sequence[int],
                            top_ps: Sequence[float],
                            min_ps: Sequence[float] | None = None) -> torch.Tensor:
    """`probs_from_logits` with settings per row: logits [S, V] -> probs [S, V]; row i equals
    probs_from_logits(logits[i], temperatures[i], top_ks[i], top_ps[i], min_ps[i]). The settings are
    host values, so min-p, top-k and top-p touch only the rows that use them, without asking the
    device."""
    dev, V = logits.device, logits.shape[-1]
    # S, V
    logits = logits.float() / torch.tensor(temperatures, dtype=torch.float32, device=dev)[:, None]
    # = clamp; a NaN row is flagged
    logits = logits.nan_to_num_(nan=0.0, posinf=_F32.max, neginf=-_F32.max)
    m_rows = [i for i, m in enumerate(min_ps or ()) if m > 0]
    if m_rows:
        idx = torch.tensor(m_rows, device=dev)
        sub = logits.index_select(0, idx)  # Sm, V
        p = sub.softmax(dim=-1)
        floor = torch.tensor([[min_ps[i]] for i in m_rows], dtype=torch.float32,
                             device=dev) * p.amax(-1, keepdim=True)
        logits = logits.index_copy(0, idx, sub.masked_fill(p < floor, float("-inf")))
    k_rows = [i for i, k in enumerate(top_ks) if 0 < k < V]
    if k_rows:
        idx = torch.tensor(k_rows, device=dev)
        sub = logits.index_select(0, idx)  # Sk, V
        top = sub.topk(max(top_ks[i] for i in k_rows), dim=-1).values  # Sk, kmax
        # Sk, 1: k-th largest
        kth = top.gather(-1, torch.tensor([[top_ks[i] - 1] for i in k_rows], device=dev))
        logits = logits.index_copy(0, idx, sub.masked_fill(sub < kth, float("-inf")))
    probs = logits.softmax(dim=-1)  # S, V
    p_rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if p_rows:
        idx = torch.tensor(p_rows, device=dev)
        sub = probs.index_select(0, idx)  # Sp, V
        # Sp, 1
        top_p = torch.tensor([[top_ps[i]] for i in p_rows], dtype=torch.float32, device=dev)
        sorted_p, order = sub.sort(dim=-1, descending=True)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # Sp, V
        drop_sorted[..., 0] = False
        kept = sub.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        probs = probs.index_copy(0, idx, kept / kept.sum(-1, keepdim=True))
    return probs


def mask_from(logits: torch.Tensor | list[torch.Tensor], first: int):
    """Logits with ids ≥ `first` at -inf, never sampled (an embedding padded past the tokenizer's
    vocabulary): [B, V] or a list of [k, V]."""
    if isinstance(logits, list):
        return [mask_from(x, first) for x in logits]
    banned = torch.full_like(logits[..., first:], float("-inf"))
    return torch.cat([logits[..., :first], banned], dim=-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A private random stream for a seeded request; None means torch's global one."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
