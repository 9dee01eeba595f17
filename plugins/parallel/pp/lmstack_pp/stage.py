"""`StageExecutor`: one rank's part of a pipeline step.

Every rank receives the whole `StepPlan` (broadcast by `MultiprocExecutor`), splits it into the
same micro-batches and runs them in order through its stage:

    stage 0:    embed + layers of mb 0 -> send | mb 1 -> send | ... | wait for logits
    stage s:    recv mb 0 -> layers -> send    | recv mb 1 -> ...
    last stage: recv mb 0 -> layers + head -> logits to rank 0 | recv mb 1 -> ...

Sends are asynchronous (`isend`), so stage s starts micro-batch m + 1 while stage s + 1 still
works on m. Rank 0 (stage 0) posts a receive for every micro-batch's logits before it starts, so
the last stage hands its results back without waiting for stage 0, and the engine samples from
them (sampling stays on the driver: the logits rows are what come back). Activations go between
ranks of consecutive stages with the same (ep, tp) position: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from lmstack.batch import ModelOutput, StepPlan
from lmstack.exec.distributed import ParallelRanks, get_parallel
from lmstack.exec.executor import ExecutorSpec, InProcessExecutor
from lmstack_pp.microbatch import split_plan

# A file path: every rank appends one JSON line per micro-batch (rank, stage, step, micro-batch,
# start, end: wall-clock seconds) — how the tests and benchmarks see stages overlap.
TRACE_ENV = "LMSTACK_PP_TRACE"


class StageExecutor(InProcessExecutor):
    def __init__(self, spec: ExecutorSpec, micro_batches: int = 0) -> None:
        super().__init__(spec)
        self.micro_batches = micro_batches
        self.steps = 0
        self._trace = os.environ.get(TRACE_ENV)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> ModelOutput | None:
        assert self.runner is not None, "load_model() first"
        ranks = get_parallel().ranks
        if ranks.pp == 1:
            return super().execute(plan)
        _check_supported(plan)
        step, self.steps = self.steps, self.steps + 1
        # An empty micro-batch (no tokens) or one without logits rows (a prompt chunk that samples
        # nothing) sends nothing where there is nothing: a zero-byte message would hang gloo.
        batches = [mb for mb in split_plan(plan, self.micro_batches or ranks.pp) if mb.plan.num_tokens]
        device, cfg = self.spec.device, self.spec.model_config
        neighbour = {
            d: ranks.rank_of(pp_rank=ranks.pp_rank + d, ep_rank=ranks.ep_rank, tp_rank=ranks.tp_rank)
            for d in (-1, 1)
            if 0 <= ranks.pp_rank + d < ranks.pp
        }
        head_rank = ranks.rank_of(pp_rank=ranks.pp - 1, ep_rank=0, tp_rank=0)  # sends the logits
        results: list[tuple[list[int], torch.Tensor, Any]] = []
        if ranks.rank == 0:
            for j, mb in enumerate(batches):
                if not mb.rows:
                    continue
                buf = torch.empty(len(mb.rows), cfg.vocab_size, dtype=torch.float32, device=device)
                results.append((mb.rows, buf, dist.irecv(buf, src=head_rank, tag=j)))
        sends: list[tuple[torch.Tensor, Any]] = []  # each tensor stays alive until its send is done
        for j, mb in enumerate(batches):
            hidden_in = None
            if -1 in neighbour:
                hidden_in = torch.empty(
                    mb.plan.num_tokens, cfg.hidden_size, dtype=self.spec.dtype, device=device
                )
                dist.recv(hidden_in, src=neighbour[-1], tag=j)
            start = time.time()
            out = self.runner.execute(mb.plan, hidden_in=hidden_in).logits.contiguous()
            self._record(ranks, step, j, start)
            if 1 in neighbour:
                sends.append((out, dist.isend(out, dst=neighbour[1], tag=j)))
            elif ranks.rank == head_rank and mb.rows:
                sends.append((out, dist.isend(out, dst=0, tag=j)))
        for _, work in sends:
            work.wait()
        if ranks.rank != 0:
            return None  # only rank 0's result goes back to the engine
        logits = torch.empty(len(plan.logits_indices), cfg.vocab_size, dtype=torch.float32, device=device)
        for rows, buf, work in results:
            work.wait()
            logits[rows] = buf
        return ModelOutput(logits=logits)

    def _record(self, ranks: ParallelRanks, step: int, mb: int, start: float) -> None:
        if not self._trace:
            return
        line = {
            "rank": ranks.rank,
            "stage": ranks.pp_rank,
            "step": step,
            "mb": mb,
            "start": start,
            "end": time.time(),
        }
        with open(self._trace, "a") as f:
            f.write(json.dumps(line) + "\n")


def _check_supported(plan: StepPlan) -> None:
    # Both would need every stage's part gathered on rank 0; not built yet.
    if plan.swap_out:
        raise RuntimeError(
            "pp: swapping KV blocks out to a lower cache tier is not supported across pipeline stages"
        )
    if plan.hidden_state_layers:
        raise RuntimeError(
            "pp: returning hidden states (a speculator reading the target's layers) is not supported "
            "across pipeline stages"
        )
