"""The tensor-parallel engine: `LLM(model, tensor_parallel_size=N)` — one scheduler, N ranks computing every step.

Rank 0 is the engine's own process. Its scheduler decides each step as usual; its model runner
(`TensorParallelRunner`) first sends the step to the other ranks, then runs its share of the forward. Ranks
1..N−1 are worker processes (`worker_main`, started with torch.multiprocessing's spawn) that load the same
checkpoint, keep their share (tensor_parallel.shard_model), hold a paged KV pool of their own heads only (the
same blocks as rank 0's: one block table serves every rank), and loop: receive a message, act on it —

    ("run", rows, num_new, num_logits, trees)   the step's forward (rows: what ModelRunner.prepare reads)
    ("copy_block", src, dst)                     a copy-on-write copy, in every rank's pool
    ("copy_slots", src, dst)                     a verified token tree's accepted path moved into place
    ("logits", ids)                              a full forward without a cache (LLM.logits)
    ("stop",)                                    leave the group and exit

Messages go out with torch.distributed.broadcast_object_list from rank 0; the all-reduces inside the forward
then keep the ranks in step. The scheduler, the block allocator and the sequences live on rank 0 only.

Launched by torchrun (`torchrun --nproc-per-node N [--nnodes ...] script.py`, every rank running the same
script): no process is spawned; the ranks join through the launcher's environment (MASTER_ADDR, RANK, ...),
so they may sit on several nodes. `LLM(model, tensor_parallel_size=N)` on rank 0 returns the engine; on the
other ranks it never returns: they follow rank 0 and exit when it is done (`torchrun_rank`).

Failure: a worker that dies (killed, out of memory) breaks the group; rank 0's next broadcast or collective
raises, and the engine stops with `TensorParallelError` naming the worker and its exit code (an EngineStateError:
fatal, the server answers 503). Shutdown: `shutdown()` (called when the engine is closed or collected, and at
interpreter exit) sends "stop", joins the workers and kills any that do not leave; a worker whose rank 0 died
sees its receive fail and exits too, so no process is left behind.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import traceback
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..engine.model_runner import ModelRunner
from ..errors import EngineStateError, NanoserveError
from .launch import exit_without_finalizing, free_port
from .tensor_parallel import check_shardable, shard_model

TIMEOUT = timedelta(seconds=60)  # a collective waiting on a rank that never comes fails, it does not hang


class TensorParallelError(EngineStateError):
    """A rank of the tensor-parallel group failed: the ranks are out of step, the engine must stop."""


@dataclasses.dataclass
class StepRow:
    """What a worker's ModelRunner.prepare reads of a sequence for one forward: its new tokens, by position."""

    seq_id: int
    num_computed_tokens: int
    token_ids: _Window
    block_table: list[int]
    lora_int_id: int = 0


class _Window:
    """The tokens a step computes, indexed by their positions in the sequence (prepare slices [start:start + n])."""

    def __init__(self, start: int, tokens: list[int]):
        self.start, self.tokens = start, tokens

    def __getitem__(self, s: slice) -> list[int]:
        return self.tokens[s.start - self.start: s.stop - self.start]


def rank_kv_config(cfg, world_size: int):
    """The config one rank's KV pool is built from: its share of the KV heads (replicated when fewer than N)."""
    return dataclasses.replace(cfg, n_kv_heads=max(1, cfg.n_kv_heads // world_size))


class WorkerGroup:
    """Rank 0's side: the worker processes and the process group they share with this process."""

    def __init__(self, model: str, dtype, device: str, world_size: int, net):
        self.closed, self.procs = True, []  # (nothing to shut down until the workers start)
        check_shardable(net, world_size)  # (rank 0's model, loaded: a refusal here starts no process)
        if dist.is_initialized():
            raise NanoserveError("tensor_parallel_size > 1: this process already belongs to a process group (one "
                                 "tensor-parallel engine per process; shut the other down first)")
        self.world_size, self.cuda = world_size, torch.device(device).type == "cuda"
        launched = torchrun_rank(world_size)  # None: start the workers here; else torchrun started every rank
        threads = max(1, torch.get_num_threads() // world_size)
        if launched is not None and launched > 0:  # this process is a worker: follow rank 0, then exit with it
            worker_main(launched, world_size, None, model, dtype, device, threads, loaded=net)
        init = "env://"  # (torchrun's MASTER_ADDR / MASTER_PORT: any host, any node)
        if launched is None:
            ctx, port = mp.get_context("spawn"), free_port()
            init = f"tcp://127.0.0.1:{port}"
            self.procs = [ctx.Process(target=worker_main, args=(r, world_size, init, model, dtype, device, threads),
                                      daemon=True, name=f"nanoserve-tp-rank{r}") for r in range(1, world_size)]
            for p in self.procs:
                p.start()
        self.closed = False
        atexit.register(_shutdown, weakref.ref(self))  # (a weak reference: the group can still be collected)
        self._guard(dist.init_process_group, "nccl" if self.cuda else "gloo", init_method=init, rank=0,
                    world_size=world_size, timeout=TIMEOUT)

    def send(self, *message) -> None:
        """One message to every worker (they all act on it)."""
        self._guard(dist.broadcast_object_list, [message], src=0)

    def _guard(self, fn, *args, **kwargs):
        """fn(...), with a failure of the group reported as which worker died, not as a socket error."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            dead = [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.procs) if not p.is_alive()]
            self.shutdown()
            raise TensorParallelError(f"the tensor-parallel group failed: {', '.join(dead) or 'no worker died'}; "
                                      f"{type(e).__name__}: {e}") from e

    def __del__(self):
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the workers (a "stop" message, then a join; a worker that does not leave is killed)."""
        if self.closed:
            return
        self.closed = True
        if all(p.is_alive() for p in self.procs):
            try:
                dist.broadcast_object_list([("stop",)], src=0)
            except Exception:  # the group is already broken: the workers leave on their own, or get killed
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()


def _shutdown(ref) -> None:
    group = ref()
    if group is not None:
        group.shutdown()


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: every forward (and every change to the KV pool) is sent to the workers first."""

    def __init__(self, group: WorkerGroup, model, *args, **kwargs):
        super().__init__(model, *args, kv_config=rank_kv_config(model.config, group.world_size), **kwargs)
        self.group = group
        self.kv = _SentCache(self.kv, group)

    def run(self, seqs, num_new, num_logits=None, trees=None):
        rows = [StepRow(s.seq_id, s.num_computed_tokens, _Window(s.num_computed_tokens, s.token_ids[
            s.num_computed_tokens:s.num_computed_tokens + n]), list(s.block_table), s.lora_int_id)
            for s, n in zip(seqs, num_new)]
        self.group.send("run", rows, list(num_new), num_logits, trees)
        return self.group._guard(super().run, seqs, num_new, num_logits, trees)

    def use_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> str | None:
        return "tensor parallelism runs eagerly (its steps are sent to the workers first)"

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of one full forward without a cache, on every rank (LLM.logits)."""
        self.group.send("logits", list(ids))
        with torch.inference_mode():
            return self.group._guard(self.model, torch.tensor([ids], device=self.device))[0].float()


class _SentCache:
    """Rank 0's KV pool: the block and slot copies are sent to the workers too; everything else is the pool's."""

    def __init__(self, cache, group: WorkerGroup):
        self._cache, self._group = cache, group

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def copy_block(self, src: int, dst: int) -> None:
        self._group.send("copy_block", src, dst)
        self._cache.copy_block(src, dst)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        self._group.send("copy_slots", list(src), list(dst))
        self._cache.copy_slots(src, dst)


def torchrun_rank(world_size: int) -> int | None:
    """This process's rank when torchrun (or any launcher setting RANK and WORLD_SIZE) started the ranks; None
    when it did not (the engine then spawns its workers). A launch of another size is refused by name."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise NanoserveError(f"tensor_parallel_size={world_size} but the launcher started WORLD_SIZE="
                             f"{os.environ['WORLD_SIZE']} processes; they must be equal")
    return int(os.environ["RANK"])


def worker_main(rank: int, world_size: int, init: str | None, model: str, dtype, device: str, threads: int,
                loaded=None) -> None:
    """A worker rank's life: join the group, load and shard the model, build its runner, follow rank 0's messages.
    `init`: the group's address (None: the launcher's environment); `loaded`: the model this process loaded
    already (a torchrun rank inside LLM(...): not loaded twice). The process ends here, it never returns."""
    from ..models.loader import load_model

    torch.set_num_threads(threads)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))  # (a multi-node launch numbers the GPUs per node)
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init or "env://", rank=rank,
                            world_size=world_size, timeout=TIMEOUT)
    try:
        net = loaded if loaded is not None else load_model(model, dtype=dtype, device=device)[0]
        cfg = net.config
        shard_model(net, rank, world_size)
        runner = None
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            op, *args = box[0]
            if op == "stop":
                break
            if op == "setup":  # num_blocks, block_size, attention_backend, kv_cache_dtype: known after rank 0 loads
                runner = ModelRunner(net, *args, kv_config=rank_kv_config(cfg, world_size))
            elif op == "run":
                runner.run(*args)
            elif op in ("copy_block", "copy_slots"):
                getattr(runner.kv, op)(*args)
            elif op == "logits":
                with torch.inference_mode():
                    net(torch.tensor([args[0]], device=device))
    except Exception:  # rank 0 died or the group broke: say why on stderr, and leave
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()
    exit_without_finalizing()


def check_tensor_parallel(world_size, spec_cfg, enable_lora: bool) -> None:
    """What the tensor-parallel engine does not run yet, refused by name before any model loads."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise NanoserveError(f"tensor_parallel_size={world_size!r} must be an integer ≥ 1")
    if world_size > 1 and spec_cfg is not None:
        raise NanoserveError("speculative decoding is not supported with tensor_parallel_size > 1 yet")
    if world_size > 1 and enable_lora:
        raise NanoserveError("enable_lora is not supported with tensor_parallel_size > 1 yet")
    if world_size > 1 and torchrun_rank(world_size) is not None and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # each rank its own GPU, before the model loads


def start_tensor_parallel(engine, world_size: int, model: str) -> WorkerGroup | None:
    """None for one rank; else start the workers, join them as rank 0, and shard rank 0's model (the engine's)."""
    if world_size == 1:
        return None
    group = WorkerGroup(model, engine.dtype, str(engine.device), world_size, engine.model)
    group._guard(shard_model, engine.model, 0, world_size)
    return group


def make_runner(group: WorkerGroup | None, model, num_blocks: int, block_size: int, attention_backend,
                kv_cache_dtype: str, lora) -> ModelRunner:
    """The engine's model runner: a plain one, or rank 0's after telling the workers how to build theirs."""
    if group is None:
        return ModelRunner(model, num_blocks, block_size, attention_backend, kv_cache_dtype, lora)
    group.send("setup", num_blocks, block_size, attention_backend, kv_cache_dtype)
    return TensorParallelRunner(group, model, num_blocks, block_size, attention_backend, kv_cache_dtype, lora)
