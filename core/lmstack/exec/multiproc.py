"""`MultiprocExecutor`: the model on N ranks joined by torch.distributed.

Two ways the ranks start:

- **spawned** (one machine; the default): the engine process starts N worker processes. Worker
  rank 0 receives each command over a pipe, broadcasts it to the other ranks
  (`broadcast_object_list`), every rank runs it, and rank 0 sends the result back. While it
  waits, the engine process also watches every worker's process sentinel: a worker that dies
  fails the call with `WorkerDied` at once instead of leaving the engine waiting.
- **launched** (`torchrun`, many machines): the launcher starts every rank and sets RANK,
  WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Global rank 0 is the `lmstack serve` process itself:
  its executor runs rank 0's model in-process and broadcasts each command and, once, the
  executor spec; the other ranks run `run_launched_worker` (what `lmstack serve` does there).

Either way every rank announces itself in the rendezvous store and waits for the others for
`join_timeout` seconds; ranks still missing then are named in one `JoinTimeout` line.

A step watchdog bounds every command: a rank that is alive but makes no progress (stopped,
deadlocked, swapping) would otherwise hang every request with no error. A step that has not
answered within `step_timeout` seconds (`LMSTACK_STEP_TIMEOUT_S`, default 60; 0: no bound) kills
the workers and raises `WorkerDied`, the path a dead rank takes: the requests in flight fail, the
server's /health turns 503 and it exits non-zero. Loading the model, sizing and allocating the
KV cache and the first step (lazy kernel set-up) get their own, longer bound, `load_timeout`
(`LMSTACK_LOAD_TIMEOUT_S`, default 1800: torch's own default for a collective). Launched ranks
get the same bounds as their process group's timeout once the first step is done, so a
collective waiting for a stopped rank fails there too.

A command that fails on one rank leaves the others out of step (waiting in a collective the
failed rank never reaches), so the executor is then dead: that call and every later one raise
an `EngineDeadError`, and the remaining workers are killed rather than left hanging.

With the reference model every rank holds a full replica (what the plumbing tests use); a
parallel layout (TP / PP / EP) gives each rank its shard through `ExecutorSpec.parallel`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmstack.batch import ModelOutput, StepPlan
from lmstack.errors import ConfigError, EngineDeadError, JoinTimeout, LmstackError, WorkerDied
from lmstack.exec.executor import ExecutorSpec, InProcessExecutor
from lmstack.exec.rendezvous import (
    JOIN_TIMEOUT_S,
    Launch,
    backend_for,
    bound_collectives,
    default_load_timeout,
    default_step_timeout,
    join,
    launch_store,
    launched,
    leave_group,
    wait_for_ranks,
)
from lmstack.interfaces import Executor
from lmstack.testing import comm_stats

# Commands that load or allocate, bounded by the load timeout (and the first "execute").
_LOAD_COMMANDS = frozenset({"load_model", "kv_cache_bytes_per_block", "init_kv_cache"})
# Idle ranks wait for the next command inside a broadcast, which times out with the process
# group (30 min by default): rank 0 sends a no-op this often when no command came.
HEARTBEAT_S = 60.0


def _stopped(pid: int | None) -> bool:
    """Whether a process is stopped (SIGSTOP, a debugger): state T or t in /proc (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _rank_spec(spec: ExecutorSpec, local_rank: int) -> ExecutorSpec:
    """The spec as this rank runs it: on a GPU, the one of its local rank."""
    if spec.device.type != "cuda":
        return spec
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return dataclasses.replace(spec, device=device)


def _rank_executor(rank: int, spec: ExecutorSpec) -> InProcessExecutor:
    ranks = getattr(spec, "parallel", None)  # a layout's ParallelRanks, when it sets one
    if ranks is not None:
        from lmstack.exec.distributed import init_parallel
        from lmstack.kernels.hardware import usable_cpus

        init_parallel(ranks.with_rank(rank))
        # torch read OMP_NUM_THREADS at import: share the host's cores between the ranks
        # instead of each rank's threads fighting over all of them.
        torch.set_num_threads(max(1, usable_cpus() // ranks.world_size))
    # A layout may build each rank's executor itself (a pipeline stage's).
    return (spec.rank_executor or InProcessExecutor)(spec)


# --- every rank but the driver: the command loop ---------------------------------------------

# Commands each rank answers itself, gathered to rank 0 as a list in rank order (not rank 0's
# answer alone), and commands that are not executor methods.
_GATHERED: dict[str, Any] = {
    "parameter_shapes": lambda local: local.parameter_shapes()[0],
    "comm_stats": lambda local: comm_stats.snapshot(),
}
_RANK_COMMANDS: dict[str, Any] = {"reset_comm_stats": lambda local: comm_stats.reset()}


def _run(local: InProcessExecutor, name: str, args: tuple) -> Any:
    if name not in _GATHERED:
        command = _RANK_COMMANDS.get(name)
        return command(local) if command is not None else getattr(local, name)(*args)
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(_GATHERED[name](local), out, dst=0)
    return out


def _command_loop(
    local: InProcessExecutor,
    relay: Any = None,
    step_timeout: float | None = None,
    heartbeat: float = HEARTBEAT_S,
) -> None:
    """Run commands until "stop". The relay (spawned rank 0) reads them from the engine's pipe,
    broadcasts them and answers on the pipe; the other ranks receive the broadcast.
    `step_timeout` (launched ranks): the collectives' bound after the first step."""
    stepped = False
    while True:
        if relay is not None:
            box: list[Any] = [relay.recv() if relay.poll(heartbeat) else ("ping", ())]
        else:
            box = [None]
        dist.broadcast_object_list(box, src=0)
        name, args = box[0]
        if name == "stop":
            return
        if name == "ping":
            continue
        result = _run(local, name, args)
        if name == "execute" and not stepped:
            stepped = True
            bound_collectives(step_timeout)
        if relay is not None:
            relay.send(result)


def _worker(
    rank: int, world_size: int, store_port: int, spec: ExecutorSpec, conn: Any, join_timeout: float
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Ctrl-C reaches the whole process group: the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    comm_stats.install_if_enabled()
    try:
        spec = _rank_spec(spec, rank)
        store = dist.TCPStore(
            "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=join_timeout)
        )
        join(store, rank, world_size, backend_for(spec.device), join_timeout, "")
        _command_loop(_rank_executor(rank, spec), conn)
    except BaseException as exc:
        if conn is not None:  # rank 0 reports; the others' exit is seen by the engine
            try:
                conn.send(exc if _picklable(exc) else RuntimeError(f"{type(exc).__name__}: {exc}"))
            except OSError:
                pass
        else:
            print(f"lmstack worker rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        os._exit(1)  # the group is out of step: no teardown collectives
    leave_group()


def _picklable(exc: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return True
    except Exception:
        return False


def run_launched_worker(join_timeout: float = JOIN_TIMEOUT_S) -> int:
    """A launched rank other than 0 (`lmstack serve` under torchrun): join, receive the executor
    spec from rank 0, run commands until rank 0 says stop. Exit status: 0 after stop, 1 when
    the group failed (rank 0 gone, a join timeout)."""
    launch = launched()
    assert launch is not None and launch.rank != 0, "rank 0 serves; run_launched_worker is for the others"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The launcher forwards SIGTERM to every rank; rank 0 drains and then tells the others to
    # stop, so the others keep serving until then (or until rank 0 is gone).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    where = f" (rendezvous at {launch.master_addr}:{launch.master_port})"
    comm_stats.install_if_enabled()
    try:
        store = launch_store(launch, join_timeout)
        try:
            backend = store.get("backend").decode()
            timeout = float(store.get("join_timeout").decode())
            load_timeout = float(store.get("load_timeout").decode()) or None
        except (RuntimeError, dist.DistError):
            raise JoinTimeout(f"rank 0 did not join within {join_timeout:g} s{where}") from None
        join(store, launch.rank, launch.world_size, backend, timeout, where, load_timeout)
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        spec = _rank_spec(box[0], launch.local_rank)
        step_timeout = store.get("step_timeout").decode()
        heartbeat = float(store.get("heartbeat").decode())
        _command_loop(_rank_executor(launch.rank, spec), None, float(step_timeout) or None, heartbeat)
    except LmstackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(
            f"error: rank {launch.rank}: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr
        )
        return 1
    leave_group()
    return 0


# --- the engine's side -----------------------------------------------------------------------


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class MultiprocExecutor(Executor):
    """`world_size` ranks; spawned here unless a launcher (torchrun) started this process as
    global rank 0. `join_timeout`: seconds the ranks get to join. `step_timeout`: seconds a
    step may take before the ranks count as stalled, `load_timeout` the same for loading and
    the first step (None: `LMSTACK_STEP_TIMEOUT_S` / `LMSTACK_LOAD_TIMEOUT_S` or 60 / 1800 s;
    0: no bound — a dead worker is still seen at once)."""

    def __init__(
        self,
        spec: ExecutorSpec,
        world_size: int,
        *,
        join_timeout: float = JOIN_TIMEOUT_S,
        step_timeout: float | None = None,
        load_timeout: float | None = None,
        local_executor: Callable[[ExecutorSpec], Executor] | None = None,
    ) -> None:
        self.spec = spec
        self.world_size = world_size
        self.join_timeout = join_timeout
        self.step_timeout = default_step_timeout() if step_timeout is None else (step_timeout or None)
        self.load_timeout = default_load_timeout() if load_timeout is None else (load_timeout or None)
        self._stepped = False  # the first "execute" has answered: steps get step_timeout
        # Idle ranks wait for the next command in a broadcast, bounded by the step timeout once
        # launched ranks bound their collectives: ping well within it.
        self._heartbeat_s = min(HEARTBEAT_S, self.step_timeout / 3) if self.step_timeout else HEARTBEAT_S
        self._dead: BaseException | None = None
        self._procs: list[Any] = []
        self._conn: Any = None
        self._local: InProcessExecutor | None = None  # launched: rank 0's own model
        # The resolved stack holds component factories (not picklable); workers don't need it,
        # nor rank 0's open model source (each worker opens the model in its own process).
        # `local_executor` (picklable) builds each rank's executor; rank 0's results come back.
        wire = dataclasses.replace(
            spec, stack=None, source=None, rank_executor=local_executor or spec.rank_executor
        )
        launch = launched()
        if launch is None:
            self._spawn(wire)
        else:
            self._join_launched(launch, wire)

    # --- spawned ---------------------------------------------------------------------------

    def _spawn(self, wire: ExecutorSpec) -> None:
        ctx = mp.get_context("spawn")
        # The engine hosts the rendezvous store (port 0: the OS picks a free one), so it can
        # see which ranks joined.
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.join_timeout),
        )
        self._conn, child = ctx.Pipe()
        args = (self.world_size, self._store.port, wire)
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, *args, child if r == 0 else None, self.join_timeout),
                daemon=True,
                name=f"lmstack-rank{r}",
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        child.close()  # rank 0 holds the only other end: its death is EOF here
        try:
            wait_for_ranks(self._store, self.world_size, self.join_timeout, "", self._check_alive)
        except JoinTimeout:
            self._kill()
            raise

    def _check_alive(self) -> None:
        for r, p in enumerate(self._procs):
            if not p.is_alive():
                raise self._fail(WorkerDied(f"worker rank {r} (pid {p.pid}) {_exit_reason(p.exitcode)}"))

    def _timeout(self, name: str) -> float | None:
        if name in _LOAD_COMMANDS or (name == "execute" and not self._stepped):
            return self.load_timeout
        return self.step_timeout

    def _reply(self, name: str) -> Any:
        waitables = [self._conn, *(p.sentinel for p in self._procs)]
        timeout = self._timeout(name)
        ready = connection.wait(waitables, timeout=timeout)
        if not ready:
            stopped = [f"rank {r} (pid {p.pid})" for r, p in enumerate(self._procs) if _stopped(p.pid)]
            why = f": worker {', '.join(stopped)} is stopped" if stopped else ""
            raise self._fail(
                WorkerDied(f"the workers made no progress in {name} for {timeout:g} s (step watchdog){why}")
            )
        dead = [r for r, p in enumerate(self._procs) if p.sentinel in ready]
        if dead:
            # A rank gone mid-command: even a result rank 0 already sent is from a group that
            # can no longer run the next step.
            procs = [self._procs[r] for r in dead]
            for p in procs:
                p.join(timeout=1)
            said = "; ".join(
                f"worker rank {r} (pid {p.pid}) {_exit_reason(p.exitcode)}"
                for r, p in zip(dead, procs, strict=True)
            )
            raise self._fail(WorkerDied(said))
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._fail(WorkerDied("worker rank 0 closed its pipe")) from None

    # --- launched ---------------------------------------------------------------------------

    def _join_launched(self, launch: Launch, wire: ExecutorSpec) -> None:
        if launch.world_size != self.world_size:
            raise ConfigError(
                f"the parallel layout runs {self.world_size} ranks, but the launcher started "
                f"WORLD_SIZE={launch.world_size}; start {self.world_size} in all (nnodes x nproc-per-node)"
            )
        if launch.rank != 0:
            raise ConfigError(
                f"only global rank 0 builds the engine; rank {launch.rank} runs run_launched_worker"
            )
        wire = _rank_spec(wire, launch.local_rank)
        comm_stats.install_if_enabled()
        store = launch_store(launch, self.join_timeout)
        store.set("backend", backend_for(wire.device))
        store.set("join_timeout", str(self.join_timeout))
        store.set("load_timeout", str(self.load_timeout or 0))
        store.set("step_timeout", str(self.step_timeout or 0))
        store.set("heartbeat", str(self._heartbeat_s))
        where = f" (rendezvous at {launch.master_addr}:{launch.master_port})"
        join(store, 0, self.world_size, backend_for(wire.device), self.join_timeout, where, self.load_timeout)
        dist.broadcast_object_list([wire], src=0)
        self._local = _rank_executor(0, dataclasses.replace(wire, source=self.spec.source))
        self._lock = threading.Lock()
        self._last_call = time.monotonic()
        self._stopping = threading.Event()
        threading.Thread(target=self._heartbeat, name="lmstack-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stopping.wait(self._heartbeat_s / 4):
            if time.monotonic() - self._last_call < self._heartbeat_s or not self._lock.acquire(
                blocking=False
            ):
                continue
            try:
                if self._dead is None and not self._stopping.is_set():
                    self._broadcast_locked("ping", ())
            except EngineDeadError:
                pass  # recorded: the next command raises it
            finally:
                self._lock.release()

    def _broadcast_locked(self, name: str, args: tuple) -> Any:
        assert self._local is not None
        self._last_call = time.monotonic()
        try:
            dist.broadcast_object_list([(name, args)], src=0)
            if name in ("ping", "stop"):
                return None
            result = _run(self._local, name, args)
            if name == "execute" and not self._stepped:
                self._stepped = True
                bound_collectives(self.step_timeout)
            return result
        except LmstackError as exc:
            self._dead = EngineDeadError(f"rank 0 failed in {name}: {exc}")
            raise
        except Exception as exc:
            reason = " ".join(str(exc).split())[:300]
            raise self._fail(
                EngineDeadError(f"rank 0 failed in {name}: {type(exc).__name__}: {reason}")
            ) from exc

    # --- both ---------------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> BaseException:
        """Record the executor as dead and stop what is left of it; returns `exc` to raise."""
        if self._dead is None:
            self._dead = exc
        self._kill()
        return exc

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)

    def _call(self, name: str, *args: Any) -> Any:
        if self._dead is not None:
            raise EngineDeadError(f"the executor is dead: {self._dead}")
        if self._local is not None:
            with self._lock:
                return self._broadcast_locked(name, args)
        self._check_alive()
        try:
            self._conn.send((name, args))
        except OSError:
            self._check_alive()
            raise self._fail(WorkerDied("worker rank 0 closed its pipe")) from None
        result = self._reply(name)
        if isinstance(result, BaseException):
            # Rank 0 stopped after reporting it: the group is gone either way.
            self._fail(result)
            if isinstance(result, LmstackError):
                raise result
            raise EngineDeadError(
                f"worker rank 0 failed in {name}: {type(result).__name__}: {result}"
            ) from result
        if name == "execute":
            self._stepped = True
        return result

    def load_model(self) -> None:
        self._call("load_model")

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self._call("kv_cache_bytes_per_block", block_size)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._call("init_kv_cache", num_blocks, block_size)

    def execute(self, plan: StepPlan) -> ModelOutput:
        return self._call("execute", plan)

    def parameter_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Every rank's parameter shapes, in rank order."""
        return self._call("parameter_shapes")

    def comm_stats(self) -> list[dict[str, dict[str, int]]]:
        """Per rank: bytes and calls per torch.distributed operation since the last reset
        (`lmstack.testing.comm_stats`; empty unless LMSTACK_COMM_STATS=1 when the ranks started)."""
        return self._call("comm_stats")

    def reset_comm_stats(self) -> None:
        self._call("reset_comm_stats")

    def shutdown(self) -> None:
        if self._local is not None:
            self._stopping.set()
            with self._lock:
                if self._dead is None:
                    try:
                        self._broadcast_locked("stop", ())
                    except BaseException:
                        pass
                self._local = None
            if dist.is_initialized():
                if self._dead is None:
                    leave_group()
                else:
                    dist.destroy_process_group()
            return
        if not self._procs:
            return
        if self._dead is None:
            try:
                self._conn.send(("stop", ()))
            except OSError:
                pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._procs = []
