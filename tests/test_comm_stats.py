"""`lmstack.testing.comm_stats` counts the bytes each torch.distributed operation moves, including the
broadcasts torch's object collectives make internally (the executor's command broadcast)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from lmstack.testing import comm_stats


def test_counts_calls_and_bytes_per_operation():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    comm_stats.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        comm_stats.reset()
        dist.all_reduce(torch.zeros(10, dtype=torch.float32))
        dist.all_gather([torch.zeros(3, dtype=torch.bfloat16)], torch.zeros(3, dtype=torch.bfloat16))
        dist.broadcast_object_list([("execute", (1, 2, 3))], src=0)
        got = comm_stats.snapshot()
        assert got["all_reduce"] == {"calls": 1, "bytes": 40}
        assert got["all_gather"] == {"calls": 1, "bytes": 6}
        # broadcast_object_list: the sizes (one int64), then the pickled payload.
        assert got["broadcast"]["calls"] == 2 and got["broadcast"]["bytes"] > 8
        comm_stats.reset()
        assert comm_stats.snapshot() == {}
    finally:
        dist.destroy_process_group()
        comm_stats.uninstall()
    assert not hasattr(dist.all_reduce, "__lmstack_counted__")
