"""`import lmstack` bounds how long idle OpenMP threads spin (`GOMP_SPINCOUNT=3000`) unless the user
chose a policy or a count: long spins collapse throughput beside a busy neighbour, sleeping at once
halves a quiet machine's decode (lmstack/__init__.py). The oracle is libgomp itself: with
`OMP_DISPLAY_ENV=verbose` it prints the spin count it settled on when torch loaded it (3000 with
lmstack, 300000 when nothing is set, 0 for PASSIVE, 3e10 for ACTIVE) — in the serving process and
in each worker process of a multi-process layout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from lmstack.testing.kit import tiny_stack

SPIN = re.compile(r"GOMP_SPINCOUNT = '(\d+)'")


def clean_env(**extra: str) -> dict[str, str]:
    # This test process imported lmstack, so its own environment has the policy already.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return {**env, "OMP_DISPLAY_ENV": "verbose", **extra}


def spin_counts(env: dict[str, str], code: str) -> list[str]:
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return SPIN.findall(run.stderr + run.stdout)


def test_baseline_without_lmstack_spins():
    # What the setting changes: torch alone leaves libgomp spinning before it sleeps.
    assert spin_counts(clean_env(), "import torch") == ["300000"]


def test_import_lmstack_before_torch_bounds_the_spin():
    assert spin_counts(clean_env(), "import lmstack, torch") == ["3000"]


def test_a_users_policy_wins():
    assert spin_counts(clean_env(OMP_WAIT_POLICY="ACTIVE"), "import lmstack, torch") == ["30000000000"]
    assert spin_counts(clean_env(OMP_WAIT_POLICY="PASSIVE"), "import lmstack, torch") == ["0"]
    assert spin_counts(clean_env(GOMP_SPINCOUNT="10"), "import lmstack, torch") == ["10"]


@pytest.mark.slow
def test_serving_process_and_its_workers_bound_the_spin(tiny_model_path):
    pytest.importorskip("lmstack_tp")
    pytest.importorskip("psutil")
    from lmstack_api.testing import ServerProcess

    srv = ServerProcess(tiny_stack(tiny_model_path, parallel={"name": "tp", "tp": 2}))
    srv.env = clean_env(OMP_NUM_THREADS="1")
    with srv:
        status, _, _ = srv.post("/v1/completions", {"prompt": "the cat", "max_tokens": 2, "temperature": 0})
        assert status == 200, srv.log()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
        counts = SPIN.findall(srv.log())
    # The server and its two ranks each loaded libgomp, all with the bounded spin.
    assert len(counts) >= 3 and set(counts) == {"3000"}, counts
