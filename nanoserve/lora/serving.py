"""Serving many LoRA adapters at once: each request names its adapter, each step mixes them.

    LoRARequest          what a request carries (vLLM's name and fields): lora_name, lora_int_id,
                         lora_path
    LoRAManager          the engine's adapters: read once from disk and kept on the host, by id;
                         copied into one of `max_loras` slots of every target layer
                         (MultiLoRALinear, batched.py) when a step needs them, the least recently
                         used adapter evicted when the slots are full
    parse_lora_modules   `nanoserve serve --lora-modules name=path ...` into LoRARequests

Who does what: the input processor checks a request's adapter when it arrives (`add`: read from
disk, its rank ≤ `max_lora_rank`, its targets in the model); the scheduler admits a sequence only
while the adapters of the running ones fit the slots (`SchedulerConfig.max_loras`); the model
runner, before each forward, gives every row its adapter's slot (`set_batch`). A layer is wrapped
the first time an adapter targets it: until then it costs the base model nothing. A sequence's
`lora_int_id` is also part of its prefix-cache key (engine/block_allocator.py): the same prompt's KV
under two adapters differs.

Slots are device memory of fixed size (S-LoRA's unified pool keeps adapters of any rank in one paged
pool; here every slot holds rank ≤ max_lora_rank, zero-padded). Adapters stay on the host once read:
a server lists its adapters up front (`nanoserve serve --lora-modules`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import NanoserveError
from ..models.moe import SparseMoeBlock
from .adapter import LoRAAdapter, load_lora_adapter, target_modules
from .batched import MultiLoRALinear

# On a CPU the segmented path (a pair of matmuls per adapter present) wins while few adapters share
# a step, the gathered one (each row's A and B copied) beyond: decode step of 32 rows, GPT-2 6 ×
# 384, rank 8 on every block linear (benchmarks/bench_lora.py): segmented 13.2 / 14.6 / 16.9 / 20.7
# ms at 1 / 4 / 8 / 16 adapters, gathered 17.2–17.9 whatever the count. On CUDA the Triton kernel
# (kernels/lora_bgmv.py) serves every mix.
SEGMENTED_UP_TO = 6


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for one request: a name (what a server's `model` field says), an id ≥ 1 that names
    it inside the engine (equal ids must mean equal adapters) and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class LoRAManager:
    """The adapters of one engine: a host registry by id, and `max_loras` slots in every target
    layer."""

    def __init__(self, model: nn.Module, config, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype):
        for name, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise NanoserveError(f"{name}={v!r} must be an integer ≥ 1")
        self.model, self.config, self.dtype = model, config, dtype
        self.device = next(model.parameters()).device  # where each forward's slot rows go
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        # read from disk, by lora_int_id
        self.adapters: dict[int, tuple[LoRARequest, LoRAAdapter]] = {}
        # adapter id -> slot, least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        self.layers: dict[str, MultiLoRALinear] = {}  # the wrapped target layers, by module name
        self.loads = 0  # adapters copied into a slot so far (a load after an eviction counts again)
        # force "segmented", "gathered" or "kernel"; None: chosen per step (above)
        self.method: str | None = None
        # a server checks requests on worker threads while the engine steps
        self._lock = threading.Lock()

    def add(self, req: LoRARequest) -> None:
        """Check and read `req`'s adapter (once per id); NanoserveError naming what is wrong."""
        if not isinstance(req, LoRARequest):
            raise NanoserveError(f"lora_request={req!r} must be a LoRARequest(lora_name, "
                                 "lora_int_id, lora_path)")
        if (
            not isinstance(req.lora_int_id, int)
            or isinstance(req.lora_int_id, bool)
            or req.lora_int_id < 1
        ):
            raise NanoserveError(f"lora_int_id={req.lora_int_id!r} must be an integer ≥ 1 (0 is "
                                 "the base model)")
        known = self.adapters.get(req.lora_int_id)
        if known is not None:
            if known[0].lora_path != req.lora_path:
                raise NanoserveError(f"lora_int_id={req.lora_int_id} already names the adapter at "
                                     f"{known[0].lora_path!r}, not {req.lora_path!r}: give each "
                                     "adapter its own id")
            return
        adapter = load_lora_adapter(req.lora_path, self.config)
        if adapter.rank > self.max_lora_rank:
            raise NanoserveError(f"adapter {req.lora_name!r} has rank r={adapter.rank}, above "
                                 f"max_lora_rank={self.max_lora_rank}; start the engine with a "
                                 "larger max_lora_rank")
        targets = target_modules(self.model, adapter)
        in_moe = {n for n, m in self.model.named_modules() if isinstance(m, SparseMoeBlock)}
        for module_name, _ in targets:
            block = next((b for b in in_moe if module_name.startswith(b + ".")), None)
            if block is not None:  # an expert sees only its routed tokens, not a row per sequence
                raise NanoserveError(f"adapter {req.lora_name!r} targets {module_name!r}, inside "
                                     "the mixture-of-experts block: per-request adapters there "
                                     "are not supported")
        # a layer no running adapter targets is wrapped: no row of a step in flight needs it
        with self._lock:
            if self.adapters.get(req.lora_int_id, (req,))[0].lora_path != req.lora_path:
                raise NanoserveError(f"lora_int_id={req.lora_int_id} was just given to another "
                                     "adapter")
            for module_name, module in targets:
                if module_name not in self.layers:
                    self._wrap(module_name, module)
            self.adapters[req.lora_int_id] = (req, adapter)

    def _wrap(self, module_name: str, module: nn.Module) -> None:
        parent_name, _, child = module_name.rpartition(".")
        layer = MultiLoRALinear(module, self.max_loras, self.max_lora_rank, self.dtype)
        # adapters already in slots that target this layer too
        for aid, slot in self.slot_of.items():
            self._load_layer(layer, module_name, self.adapters[aid][1], slot)
        setattr(self.model.get_submodule(parent_name) if parent_name else self.model, child, layer)
        self.layers[module_name] = layer

    def _load_layer(self, layer: MultiLoRALinear, module_name: str, adapter: LoRAAdapter,
                    slot: int) -> None:
        A, B = adapter.factors.get(f"{module_name}.weight", (None, None))
        dev = layer.lora_A.device
        layer.set_adapter(slot, None if A is None else A.to(dev), None if B is None else B.to(dev))

    def activate(self, ids: set[int]) -> dict[int, int]:
        """A slot for each adapter id in `ids` (0, the base, needs none), copying in those not
        loaded and evicting the least recently used others. The scheduler admits at most max_loras
        at a time."""
        ids = {i for i in ids if i}
        if len(ids) > self.max_loras:
            raise NanoserveError(f"a step needs {len(ids)} adapters but there are "
                                 f"max_loras={self.max_loras} slots")
        for aid in ids:
            if aid in self.slot_of:
                self.slot_of.move_to_end(aid)
                continue
            free = set(range(self.max_loras)) - set(self.slot_of.values())
            if free:
                slot = min(free)
            else:  # evict the least recently used adapter this step does not need
                victim = next(a for a in self.slot_of if a not in ids)
                slot = self.slot_of.pop(victim)
            for module_name, layer in self.layers.items():
                self._load_layer(layer, module_name, self.adapters[aid][1], slot)
            self.slot_of[aid] = slot
            self.loads += 1
        return {aid: self.slot_of[aid] for aid in ids}

    def set_batch(self, lora_ids: list[int], device: torch.device) -> None:
        """Before a forward: row b of the batch computes under adapter lora_ids[b] (0: the base
        alone)."""
        with self._lock:
            slot = self.activate(set(lora_ids))
            rows = [slot.get(i, -1) for i in lora_ids]
            slots, present = torch.tensor(rows, dtype=torch.long,
                                          device=device), sorted(set(rows) - {-1})
            method = self.method or ("kernel" if device.type == "cuda" else
                                     "segmented" if len(present) <= SEGMENTED_UP_TO else "gathered")
            for layer in self.layers.values():
                layer.set_slots(slots, present)
                layer.method = method

    @contextmanager
    def batch_context(self, seqs: list) -> Iterator[None]:
        """A forward of `seqs` under their adapters (ModelRunner.around_forward): `set_batch`
        before it, `clear` after, whether it returned or raised."""
        self.set_batch([s.lora_int_id for s in seqs], self.device)
        try:
            yield
        finally:
            self.clear()

    def clear(self) -> None:
        """After a forward: no layer keeps its rows' slots (a later forward outside the engine,
        `LLM.logits` say, is the base model's, not the last step's adapters')."""
        for layer in self.layers.values():
            layer.set_slots(None, [])


def parse_lora_modules(specs: list[str]) -> dict[str, LoRARequest]:
    """`name=path` each (vLLM's `--lora-modules`): a LoRARequest per name, with ids 1, 2, ... in
    order."""
    out: dict[str, LoRARequest] = {}
    for spec in specs:
        name, eq, path = spec.partition("=")
        if not eq or not name or not path:
            raise NanoserveError(f"--lora-modules {spec!r}: give each adapter as name=path")
        if name in out:
            raise NanoserveError(f"--lora-modules: the name {name!r} is given twice")
        out[name] = LoRARequest(name, len(out) + 1, path)
    return out
