"""`MultiprocExecutor`: the model in N worker processes joined by torch.distributed.

The engine process drives; worker rank 0 receives each command over a pipe, broadcasts it to
the other ranks (`broadcast_object_list`), every rank runs it, and rank 0 sends the result
back. A parallel layout (TP / PP / EP) builds on this by giving each rank its shard; with the
reference model every rank holds a full replica, which is what the tests use to check the
plumbing.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmstack.batch import ModelOutput, StepPlan
from lmstack.distributed import init_parallel
from lmstack.executor import ExecutorSpec, InProcessExecutor
from lmstack.interfaces import Executor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    spec: ExecutorSpec,
    conn: Any,
    local_executor: Callable[[ExecutorSpec], Executor] = InProcessExecutor,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if spec.device.type == "cuda" and spec.parallel is not None:  # one GPU per rank (NCCL needs it)
        spec = dataclasses.replace(spec, device=torch.device("cuda", rank % torch.cuda.device_count()))
        torch.cuda.set_device(spec.device)
    backend = "nccl" if spec.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    if spec.parallel is not None:  # this rank's place in the layout: its model shard and groups
        init_parallel(spec.parallel.with_rank(rank))
        # torch read OMP_NUM_THREADS at import, before the line above could set it: share the
        # cores between the ranks instead of each rank's threads fighting over all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    local = local_executor(spec)
    try:
        while True:
            cmd: list[Any] = [conn.recv() if rank == 0 else None]
            dist.broadcast_object_list(cmd, src=0)
            name, args = cmd[0]
            if name == "stop":
                break
            result = getattr(local, name)(*args)
            if rank == 0:
                conn.send(result)
    except Exception as exc:  # report instead of leaving the driver waiting
        if rank == 0:
            conn.send(RuntimeError(f"worker rank {rank} failed: {exc!r}"))
    finally:
        dist.destroy_process_group()


class MultiprocExecutor(Executor):
    def __init__(
        self,
        spec: ExecutorSpec,
        world_size: int,
        *,
        local_executor: Callable[[ExecutorSpec], Executor] = InProcessExecutor,
    ) -> None:
        """`local_executor` (picklable) builds each rank's executor (a pipeline stage's, say);
        rank 0's results come back."""
        self.spec = spec
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        port = _free_port()
        # The resolved stack holds component factories (not picklable); workers don't need it.
        wire = dataclasses.replace(spec, stack=None)
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, wire, child if r == 0 else None, local_executor),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def _call(self, name: str, *args: Any) -> Any:
        self._conn.send((name, args))
        result = self._conn.recv()
        if isinstance(result, Exception):
            raise result
        return result

    def load_model(self) -> None:
        self._call("load_model")

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self._call("kv_cache_bytes_per_block", block_size)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._call("init_kv_cache", num_blocks, block_size)

    def execute(self, plan: StepPlan) -> ModelOutput:
        return self._call("execute", plan)

    def shutdown(self) -> None:
        if not self._procs:
            return
        try:
            self._conn.send(("stop", ()))
        except OSError:
            pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._procs = []
