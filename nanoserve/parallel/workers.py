"""The engine over N ranks: `LLM(model, tensor_parallel_size=N)` or `pipeline_parallel_size=N` — one
scheduler, N ranks computing every step.

Rank 0 is the engine's own process. Its scheduler decides each step as usual; its model runner
(runners.LeaderRunner) first sends the step to the other ranks, then runs its share of the forward.
Ranks
1..N−1 are worker processes (`worker_main`, started with torch.multiprocessing's spawn) that load
the same checkpoint, keep their share (runners.split_for_rank: a slice of every layer, or a stage's
blocks), hold a paged KV pool of their share only (their heads, or their layers; the same blocks as
rank 0's: one block table serves every rank), and loop: receive a message, act on it —

    ("setup", num_blocks, block_size, attention_backend, kv_cache_dtype)   build the rank's runner
    ("run", rows, num_new, num_logits, trees)   the step's forward (rows: what ModelRunner.prepare
                                                reads)
    ("copy_block", src, dst)                     a copy-on-write copy, in every rank's pool
    ("copy_slots", src, dst)                     a verified token tree's accepted path moved into
                                                 place
    ("logits", ids)                              a full forward without a cache (LLM.logits)
    ("stop",)                                    leave the group and exit

Messages go out with torch.distributed.broadcast_object_list from rank 0, on a group of their own
(`control`) whose waits never time out: a server may sit idle for hours, and a worker waiting for
its next message must not give up after the 60 s the exchanges inside a step are allowed (it did: an
idle 2-rank server lost its worker after a minute). A dead rank 0 still ends that wait at once: its
sockets close. Within a forward the ranks then meet in the all-reduces (tensor) or pass activations
from stage to stage (pipeline: stage_runner.py). The scheduler, the block allocator and the
sequences live on rank 0 only.

Launched by torchrun (`torchrun --nproc-per-node N [--nnodes ...] script.py`, every rank running the
same script): no process is spawned; the ranks join through the launcher's environment (MASTER_ADDR,
RANK, ...), so they may sit on several nodes. `LLM(model, tensor_parallel_size=N)` on rank 0 returns
the engine; on the other ranks it never returns: they follow rank 0 and exit when it is done
(config.torchrun_rank).

Failure: a worker that dies (killed, out of memory) breaks the group; rank 0's next message or
exchange raises, and the engine stops with `WorkerGroupError` naming the worker and its exit code
(an EngineStateError: fatal, the server answers 503 and exits). Shutdown: `shutdown()` (called when
the engine is closed or collected, and at interpreter exit) sends "stop", joins the workers and
kills any that do not leave; a worker whose rank 0 died sees its receive fail and exits too, so no
process is left behind.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..engine.model_runner import ModelRunner
from ..errors import EngineStateError, NanoserveError
from .config import ParallelConfig, pin_rank_device, torchrun_rank  # noqa: F401  (the engine's)
from .launch import exit_without_finalizing, free_port
from .runners import LeaderRunner, check_split, rank_runner, split_for_rank

# an exchange inside a step
TIMEOUT = timedelta(seconds=float(os.environ.get("NANOSERVE_DIST_TIMEOUT", 60)))
# waiting on a rank that never comes fails, it does not hang (the variable: tests shorten it)
# the control group's: how long a worker waits for rank 0's next message
IDLE = timedelta(days=3650)
DEATH_WAIT = 10.0  # seconds a failed exchange waits for a worker's exit to be reported (see guard)


class WorkerGroupError(EngineStateError):
    """A rank of the group failed: the ranks are out of step, the engine must stop."""


class WorkerGroup:
    """Rank 0's side: the worker processes and the process group they share with this process."""

    def __init__(self, model: str, dtype, device: str, parallel: ParallelConfig, net):
        self.closed, self.procs = True, []  # (nothing to shut down until the workers start)
        check_split(net, parallel)  # (rank 0's model, loaded: a refusal here starts no process)
        if dist.is_initialized():
            raise NanoserveError(f"{parallel.size_name}: this process already belongs to a process "
                                 "group (one split engine per process; shut the other down first)")
        self.parallel, world_size = parallel, parallel.world_size
        self.cuda = torch.device(device).type == "cuda"
        # None: start the workers here; else torchrun started every rank
        launched = torchrun_rank(parallel)
        threads = max(1, torch.get_num_threads() // world_size)
        # this process is a worker: follow rank 0, then exit with it
        if launched is not None and launched > 0:
            worker_main(launched, parallel, None, model, dtype, device, threads, loaded=net)
        init = "env://"  # (torchrun's MASTER_ADDR / MASTER_PORT: any host, any node)
        if launched is None:
            ctx, port = mp.get_context("spawn"), free_port()
            init = f"tcp://127.0.0.1:{port}"
            self.procs = [
                ctx.Process(
                    target=worker_main, args=(r, parallel, init, model, dtype, device, threads),
                    daemon=True, name=f"nanoserve-rank{r}",
                )
                for r in range(1, world_size)
            ]
            for p in self.procs:
                p.start()
        self.closed = False
        # (a weak reference: the group can still be collected)
        atexit.register(_shutdown, weakref.ref(self))
        self.guard(
            dist.init_process_group, "nccl" if self.cuda else "gloo", init_method=init, rank=0,
            world_size=world_size, timeout=TIMEOUT,
        )
        # rank 0's messages (above)
        self.control = self.guard(dist.new_group, backend="gloo", timeout=IDLE)

    def send(self, *message) -> None:
        """One message to every worker (they all act on it)."""
        self.guard(dist.broadcast_object_list, [message], src=0, group=self.control)

    def guard(self, fn, *args, **kwargs):
        """fn(...), with a failure of the group reported as which worker died, not as a socket
        error."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            # A killed worker's sockets close while it dies, before the OS reports its exit: rank 0
            # can see the connection drop first. Wait for the first worker's exit (an event,
            # bounded), then name the dead.
            if self.procs and all(p.is_alive() for p in self.procs):
                ready = wait([p.sentinel for p in self.procs], timeout=DEATH_WAIT)
                # (a sentinel is ready as the process closes its files, a moment before
                for p in self.procs:
                    if p.sentinel in ready:  # its exit can be reaped: join waits for that)
                        p.join()
            dead = [f"rank {i + 1} (exit code "
                    f"{p.exitcode})" for i, p in enumerate(self.procs) if not p.is_alive()]
            self.shutdown()
            raise WorkerGroupError(f"the {self.parallel.kind}-parallel group failed: "
                                   f"{', '.join(dead) or 'no worker died'}; {type(e).__name__}: "
                                   f"{e}") from e

    def __del__(self):
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the workers (a "stop" message, then a join; a worker that does not leave is
        killed)."""
        if self.closed:
            return
        self.closed = True
        if all(p.is_alive() for p in self.procs):
            try:
                dist.broadcast_object_list([("stop",)], src=0, group=self.control)
            except Exception:
                # the group is already broken: the workers leave on their own, or get killed
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


def worker_main(rank: int, parallel: ParallelConfig, init: str | None, model: str, dtype,
                device: str,
                threads: int, loaded=None) -> None:
    """A worker rank's life: join the group, load the model and keep its share, build its runner,
    follow rank 0's messages. `init`: the group's address (None: the launcher's environment);
    `loaded`: the model this process loaded already (a torchrun rank inside LLM(...): not loaded
    twice). The process ends here."""
    from ..models.loader import load_model

    torch.set_num_threads(threads)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        # (a multi-node launch numbers the GPUs per node)
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init or "env://", rank=rank,
                            world_size=parallel.world_size, timeout=TIMEOUT)
    # rank 0's messages: waits that never time out
    control = dist.new_group(backend="gloo", timeout=IDLE)
    try:
        net = loaded if loaded is not None else load_model(model, dtype=dtype, device=device)[0]
        num_layers = net.config.n_layers
        split_for_rank(net, parallel, rank)
        runner = None
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            op, *args = box[0]
            if op == "stop":
                break
            # setup's num_blocks, block_size, attention_backend, kv_cache_dtype: known after rank 0
            # loads
            if op == "setup":
                runner = rank_runner(net, parallel, rank, num_layers, *args)
            elif op == "run":
                runner.run(*args)
            elif op in ("copy_block", "copy_slots"):
                getattr(runner.kv, op)(*args)
            elif op == "logits":
                runner.logits(*args)
    except Exception:  # rank 0 died or the group broke: say why on stderr, and leave
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()
    exit_without_finalizing()


def start_workers(engine, parallel: ParallelConfig, model: str) -> WorkerGroup | None:
    """None for one rank; else start the workers, join them as rank 0, and split rank 0's model (the
    engine's)."""
    if parallel.world_size == 1:
        return None
    group = WorkerGroup(model, engine.dtype, str(engine.device), parallel, engine.model)
    group.guard(split_for_rank, engine.model, parallel, 0)
    return group


def make_runner(group: WorkerGroup | None, model, num_blocks: int, block_size: int,
                attention_backend, kv_cache_dtype: str):
    """The engine's model runner: a plain one, or rank 0's after telling the workers how to build
    theirs."""
    if group is None:
        return ModelRunner(model, num_blocks, block_size, attention_backend, kv_cache_dtype)
    group.send("setup", num_blocks, block_size, attention_backend, kv_cache_dtype)
    leader = rank_runner(model, group.parallel, 0, model.config.n_layers, num_blocks, block_size,
                         attention_backend, kv_cache_dtype)
    return LeaderRunner(group, leader)
