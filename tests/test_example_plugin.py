"""The example third-party plugin (examples/plugins/priority-scheduler), as an installed package.

These need `pip install -e examples/plugins/priority-scheduler` (`make install` does it). The
engine-level behaviour (conformance kit, finishing order) is tested with the engine.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from lmstack import cli
from lmstack.errors import ConfigError
from lmstack.interfaces import EngineLimits
from lmstack.stack.config import load_stack
from lmstack.stack.plugins import build_registry, make_plugin_manager
from lmstack.stack.resolve import resolve
from lmstack.testing.fakes import make_seq

DIST = "lmstack-priority-scheduler"


@pytest.fixture
def only_priority(monkeypatch):
    monkeypatch.delenv("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setenv("LMSTACK_PLUGINS", "priority")


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="lmstack", name="priority")
    assert [ep.value for ep in eps] == ["lmstack_priority_scheduler"]
    assert next(iter(eps)).dist.metadata["Name"] == DIST


def test_discovered_and_attributed(only_priority):
    registry = build_registry(make_plugin_manager())
    comp = registry.get("scheduler", "priority")
    assert comp.distribution == DIST
    assert comp.version == importlib.metadata.version(DIST)
    assert comp.capabilities == {"chunked_prefill": True, "preemption": "recompute"}
    assert "policy" in comp.option_names and "max_num_seqs" in comp.option_names


def test_listed_by_lmstack_plugins(only_priority, capsys):
    assert cli.main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    row = next(r for r in rows if r["kind"] == "scheduler" and r["name"] == "priority")
    assert row["distribution"] == DIST


def test_selected_from_yaml(only_priority, tmp_path):
    path = tmp_path / "stack.yaml"
    path.write_text("scheduler: {name: priority, policy: shortest-first, max_num_seqs: 4}\n")
    r = resolve(load_stack(path), build_registry(make_plugin_manager()))
    assert r.scheduler.name == "priority"
    assert r.scheduler.options.policy == "shortest-first"
    assert r.scheduler.options.max_num_seqs == 4  # continuous' options still apply
    assert r.describe()["components"]["scheduler"]["distribution"] == DIST


def test_bad_policy_names_the_path(only_priority):
    with pytest.raises(ConfigError) as info:
        resolve(
            load_stack({"scheduler": {"name": "priority", "policy": "lottery"}}),
            build_registry(make_plugin_manager()),
        )
    assert info.value.path == "scheduler.policy"
    assert "'priority', 'shortest-first'" in str(info.value)


def test_not_loaded_when_autoload_is_off(monkeypatch):
    monkeypatch.setenv("LMSTACK_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "priority" not in build_registry(make_plugin_manager()).names("scheduler")


def test_waiting_order_keys():
    from lmstack_priority_scheduler import PriorityOptions, PriorityScheduler

    limits = EngineLimits(max_model_len=1000, max_num_seqs=8, max_num_batched_tokens=256)
    early_low = make_seq(10, max_tokens=500, priority=5, arrival=1.0)
    late_high = make_seq(300, max_tokens=10, priority=0, arrival=2.0)
    short = make_seq(20, max_tokens=20, priority=9, arrival=3.0)
    unbounded = make_seq(5, max_tokens=8, arrival=0.5)
    unbounded.request.params.max_tokens = None  # may run to the context length

    by_priority = PriorityScheduler(PriorityOptions(), allocator=None, limits=limits)  # type: ignore[arg-type]
    seqs = [early_low, short, late_high, unbounded]
    assert sorted(seqs, key=by_priority.waiting_order_key) == [unbounded, late_high, early_low, short]

    shortest = PriorityScheduler(PriorityOptions(policy="shortest-first"), allocator=None, limits=limits)  # type: ignore[arg-type]
    assert sorted(seqs, key=shortest.waiting_order_key) == [short, late_high, early_low, unbounded]


# --- the plugin against the core's conformance kit and on the real engine ------------------------

from lmstack.testing import SchedulerConformance  # noqa: E402


class TestPriorityConformance(SchedulerConformance):
    component = "priority"  # the installed entry point's component, as a plugin's own tests name it
    options = {"policy": "priority"}


class TestShortestFirstConformance(SchedulerConformance):
    component = "priority"
    options = {"policy": "shortest-first"}


def _finish_order(scheduler: dict, jobs: list[tuple[int, int]]) -> list[int]:
    """Run prompts (priority, max_tokens) one at a time on the real model; return the job
    indices in the order they finished."""
    from lmstack import SamplingParams
    from lmstack.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        {
            "model": "smollm2-135m-instruct",
            "dtype": "bfloat16",
            "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": 256, **scheduler},
            "allocator": {"name": "paged", "num_blocks": 64},
        }
    )
    prompt = engine.tokenizer.encode("Once upon a time")
    ids = {}
    for i, (prio, max_tokens) in enumerate(jobs):
        rid = engine.add_request(
            prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), priority=prio
        )
        ids[rid] = i
    order = []
    while engine.has_unfinished():
        order += [ids[o.request_id] for o in engine.step() if o.finished]
    return order


def test_selected_from_yaml_changes_finishing_order(only_priority):
    jobs = [(5, 6), (1, 4), (3, 2), (0, 3)]  # (priority, max_tokens), submitted in this order
    # `continuous` orders by priority class too (issue 59); the plugin's own policy differs.
    assert _finish_order({"name": "continuous"}, jobs) == [3, 1, 2, 0]
    assert _finish_order({"name": "continuous"}, [(0, m) for _, m in jobs]) == [0, 1, 2, 3]  # FCFS
    assert _finish_order({"name": "priority"}, jobs) == [3, 1, 2, 0]  # lowest priority value first
    assert _finish_order({"name": "priority", "policy": "shortest-first"}, jobs) == [2, 3, 1, 0]
