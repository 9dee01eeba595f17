"""Joining a group of ranks and bounding it: what a launcher (torchrun) says about this process,
the rendezvous every rank announces itself in, the process group's collective timeouts (the step
watchdog's bounds, `lmstack.exec.multiproc`), and leaving the group together.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lmstack.errors import ConfigError, JoinTimeout

JOIN_TIMEOUT_S = 60.0
STEP_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 1800.0
_JOINED = "joined/{}"


def seconds_from_env(name: str, default: float) -> float | None:
    """A timeout in seconds from the environment (`default` when unset); None for 0 (no bound)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds (0: no bound), got {raw!r}") from None
    if value < 0 or value != value:
        raise ConfigError(f"{name} must be >= 0 seconds (0: no bound), got {raw!r}")
    return value or None


def default_step_timeout() -> float | None:
    """Seconds one step may take before the ranks count as stalled (`LMSTACK_STEP_TIMEOUT_S`)."""
    return seconds_from_env("LMSTACK_STEP_TIMEOUT_S", STEP_TIMEOUT_S)


def default_load_timeout() -> float | None:
    """Seconds loading and the first step may take (`LMSTACK_LOAD_TIMEOUT_S`)."""
    return seconds_from_env("LMSTACK_LOAD_TIMEOUT_S", LOAD_TIMEOUT_S)


# --- launch environment and joining ----------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """What a launcher (torchrun, or a scheduler setting the same variables) says about this
    process."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent on node 0 already hosts the store at MASTER_PORT
    attempt: str  # restarts of the worker group so far: keys of an earlier attempt are stale


def launched() -> Launch | None:
    """The launcher's view of this process; None when no launcher set RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT (the engine then spawns its own workers)."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    try:
        rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        local = int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        raise ConfigError(
            "RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers "
            f"(got {env['RANK']!r}, {env['WORLD_SIZE']!r}, {env.get('LOCAL_RANK')!r}, {env['MASTER_PORT']!r})"
        ) from None
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return Launch(
        rank,
        world,
        local,
        env["MASTER_ADDR"],
        port,
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        env.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )


def launch_store(launch: Launch, timeout: float) -> dist.Store:
    where = f"{launch.master_addr}:{launch.master_port}"
    hosts = launch.rank == 0 and not launch.agent_store
    try:
        store = dist.TCPStore(
            launch.master_addr,
            launch.master_port,
            is_master=hosts,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
        )
    except (RuntimeError, dist.DistError) as exc:
        what = "cannot host" if hosts else "cannot reach rank 0's"
        reason = " ".join(str(exc).split())[:200]
        raise JoinTimeout(f"rank {launch.rank} {what} rendezvous store at {where} ({reason})") from None
    return dist.PrefixStore(f"lmstack/{launch.attempt}", store)


def wait_for_ranks(store: dist.Store, world_size: int, timeout: float, where: str, alive=None) -> None:
    """Until every rank has set its `joined` key; JoinTimeout naming the missing ones after
    `timeout` s. `alive()` (optional) is checked while waiting and may raise."""
    keys = [_JOINED.format(r) for r in range(world_size)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            names = ", ".join(map(str, missing))
            raise JoinTimeout(
                f"rank{'s' if len(missing) > 1 else ''} {names} of {world_size} did not join within "
                f"{timeout:g} s{where}"
            )
        time.sleep(0.02)


def join(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    where: str,
    collective_timeout: float | None = None,
) -> None:
    """Join the group; `collective_timeout`: how long a collective may wait (None: torch's default)."""
    store.set(_JOINED.format(rank), "1")
    wait_for_ranks(store, world_size, timeout, where)
    extra = {} if collective_timeout is None else {"timeout": timedelta(seconds=collective_timeout)}
    dist.init_process_group(
        backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size, **extra
    )


def bound_collectives(seconds: float | None) -> None:
    """From now on, a collective of this rank's groups (the world and the layout's) waiting
    longer than `seconds` for another rank raises: a stalled launched rank then fails the step
    on every rank instead of hanging it. Called once the first step is done."""
    if seconds is None or not dist.is_initialized():
        return
    from lmstack.exec.distributed import get_parallel

    state = get_parallel()
    layout = [state.tp_group, state.ep_group, state.moe_group, state.pp_group]
    for group in [dist.group.WORLD, *(g for g in layout if g is not None)]:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def leave_group() -> None:
    """Tear the group down together after "stop": a rank that closed its connections while
    another still read the last broadcast made gloo print "connection closed by peer"."""
    try:
        dist.barrier()
    except (RuntimeError, dist.DistError):
        pass  # a rank already gone: nothing left to wait for
    dist.destroy_process_group()
