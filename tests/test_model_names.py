"""Models named as users name them: Hugging Face Hub ids (`org/name`, `@revision`, a GGUF of a
repository as `org/name:Q8_0` or `org/name/file.gguf`), resolved through huggingface_hub's cache
in a temporary HF_HOME with HF_HUB_OFFLINE=1 (there is no network here).

The cache is written in huggingface_hub's documented layout (models--org--name/{blobs, refs,
snapshots/<commit>}); huggingface_hub itself is the oracle that it is right: `scan_cache_dir`,
`try_to_load_from_cache` and `snapshot_download(local_files_only=True)` read it back. Downloads,
and the Hub's answers for gated, missing and private repositories, come from a small local
stand-in for the Hub's HTTP API (`FakeHub`, at HF_ENDPOINT), which huggingface_hub talks to as
it talks to the Hub."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import huggingface_hub
import pytest
from huggingface_hub import constants as hub_constants

from lmstack import cli
from lmstack.errors import ConfigError
from lmstack.model import source as model_source
from lmstack.model.source import HubModel, resolve_model_path
from lmstack.testing.tiny_model import write_tiny_model

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def cache_repo(
    hub_cache: Path, repo: str, files: dict[str, bytes], commit: str, refs: tuple[str, ...] = ("main",)
) -> Path:
    """One revision of a model repository in the Hub cache layout: each file's bytes once under
    blobs/ (named by their sha256, as LFS files are), a relative symlink to it under
    snapshots/<commit>/, and refs/<branch or tag> holding the commit. Returns the snapshot."""
    storage = hub_cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def tiny_model_files(folder: Path, **kw) -> dict[str, bytes]:
    # head_dim 64: every attention kernel takes it (the cpu-paged kernels need 64 or 128).
    write_tiny_model(folder, hidden_size=128, num_heads=2, num_kv_heads=1, **kw)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hub cache in a temporary HF_HOME, offline: for this process (huggingface_hub read
    its environment when first imported, so its constants are set too) and for the servers it
    starts (the environment)."""
    home = tmp_path / "hf"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HOME", str(home))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(model_source, "_hub_resolved", {})
    return cache


@pytest.fixture
def tiny_repo(hub, tmp_path) -> Path:
    """`test-org/tiny-llama`: main at COMMIT_A (2 layers); tag v1 at COMMIT_B (1 layer)."""
    cache_repo(hub, "test-org/tiny-llama", tiny_model_files(tmp_path / "a"), COMMIT_A)
    cache_repo(hub, "test-org/tiny-llama", tiny_model_files(tmp_path / "b", num_layers=1), COMMIT_B, ("v1",))
    return hub


@pytest.fixture
def gguf_repo(hub) -> Path:
    """`test-org/tiny-GGUF`: three quantizations of one model, one split in two, and a README."""
    files = {
        "tiny-Q8_0.gguf": b"GGUF q8_0 bytes",
        "tiny-Q4_K_M.gguf": b"GGUF q4_k_m bytes",
        "tiny-Q4_K_S.gguf": b"GGUF q4_k_s bytes",
        "Q6_K/tiny-Q6_K-00001-of-00002.gguf": b"GGUF q6_k bytes, part 1",
        "Q6_K/tiny-Q6_K-00002-of-00002.gguf": b"GGUF q6_k bytes, part 2",
        "README.md": b"# tiny\n",
    }
    return cache_repo(hub, "test-org/tiny-GGUF", files, COMMIT_A)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# The cache layout, checked by huggingface_hub
# ---------------------------------------------------------------------------------------------


def test_the_cache_layout_is_huggingface_hubs(tiny_repo):
    info = huggingface_hub.scan_cache_dir(tiny_repo)
    assert info.warnings == []
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == ("test-org/tiny-llama", "model")
    revisions = {r.commit_hash: r for r in repo.revisions}
    assert set(revisions) == {COMMIT_A, COMMIT_B}
    assert revisions[COMMIT_A].refs == {"main"} and revisions[COMMIT_B].refs == {"v1"}
    assert {f.file_name for f in revisions[COMMIT_A].files} >= {"config.json", "model.safetensors"}
    config = huggingface_hub.try_to_load_from_cache("test-org/tiny-llama", "config.json")
    assert config == str(tiny_repo / "models--test-org--tiny-llama" / "snapshots" / COMMIT_A / "config.json")
    folder = huggingface_hub.snapshot_download("test-org/tiny-llama", revision="v1", local_files_only=True)
    assert Path(folder).name == COMMIT_B


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------


def test_an_id_resolves_to_its_cached_snapshot(tiny_repo):
    assert (
        resolve_model_path("test-org/tiny-llama")
        == tiny_repo / "models--test-org--tiny-llama" / "snapshots" / COMMIT_A
    )


@pytest.mark.parametrize("revision", ["v1", COMMIT_B])
def test_a_revision_picks_that_cached_revision(tiny_repo, revision):
    path = resolve_model_path(f"test-org/tiny-llama@{revision}")
    assert path.name == COMMIT_B
    source = model_source.open_model_source(f"test-org/tiny-llama@{revision}")
    assert source.config.num_layers == 1 and source.name == f"test-org/tiny-llama@{revision}"


def test_an_uncached_revision_is_one_line(tiny_repo):
    with pytest.raises(ConfigError) as exc:
        resolve_model_path("test-org/tiny-llama@v2")
    message = str(exc.value)
    assert "'test-org/tiny-llama@v2'" in message and "HF_HUB_OFFLINE" in message
    assert "`hf download test-org/tiny-llama --revision v2`" in message and "\n" not in message


@pytest.mark.parametrize("tag", ["Q8_0", "q8_0"])
def test_a_quantization_tag_picks_that_gguf(gguf_repo, tag):
    path = resolve_model_path(f"test-org/tiny-GGUF:{tag}")
    assert path == gguf_repo / "tiny-Q8_0.gguf" and path.read_bytes() == b"GGUF q8_0 bytes"


def test_a_gguf_file_of_a_repository(gguf_repo):
    assert resolve_model_path("test-org/tiny-GGUF/tiny-Q4_K_S.gguf").read_bytes() == b"GGUF q4_k_s bytes"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # A split model is several files, not one.
        (
            "test-org/tiny-GGUF:Q6_K",
            "2 .gguf files carry 'Q6_K' (Q6_K/tiny-Q6_K-00001-of-00002.gguf, Q6_K/tiny-Q6_K-00002-of-00002.gguf)",
        ),
        # A tag is a whole tag: Q4_K is neither Q4_K_M nor Q4_K_S, Q8 is not Q8_0.
        (
            "test-org/tiny-GGUF:Q4_K",
            "no .gguf file of test-org/tiny-GGUF carries 'Q4_K'; it has Q6_K/tiny-Q6_K-0",
        ),
        (
            "test-org/tiny-GGUF:Q8",
            "no .gguf file of test-org/tiny-GGUF carries 'Q8'; it has Q6_K/tiny-Q6_K-0",
        ),
        ("test-org/tiny-GGUF", "holds GGUF files, not a Hugging Face model: name one by its quantization"),
    ],
)
def test_a_tag_that_names_no_single_gguf_is_one_line_listing_the_files(gguf_repo, name, expected):
    with pytest.raises(ConfigError) as exc:
        resolve_model_path(name)
    assert expected in str(exc.value) and "\n" not in str(exc.value)
    if not expected.startswith("2 "):  # the rest list every file
        assert "tiny-Q8_0.gguf" in str(exc.value)


def test_a_local_path_wins_over_an_id_of_the_same_spelling(tiny_repo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_tiny_model(tmp_path / "test-org" / "tiny-llama")
    assert resolve_model_path("test-org/tiny-llama") == Path("test-org/tiny-llama")


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("org/name", ("org/name", None, None, None)),
        ("Org.x/Name-1.5B_it@v1.0", ("Org.x/Name-1.5B_it", "v1.0", None, None)),
        ("org/name-GGUF:Q4_K_M", ("org/name-GGUF", None, "Q4_K_M", None)),
        ("org/name@" + COMMIT_A + ":IQ4_XS", ("org/name", COMMIT_A, "IQ4_XS", None)),
        ("org/name/sub/model-f16.GGUF", ("org/name", None, None, "sub/model-f16.GGUF")),
        ("./org/name", None),
        ("/abs/path", None),
        ("~/models/x", None),
        ("org/name/file.safetensors", None),
        ("smollm2-135m-instruct", None),
    ],
)
def test_what_is_an_id(text, parsed):
    hub = HubModel.parse(text)
    assert (hub and (hub.repo, hub.revision, hub.tag, hub.file)) == parsed


# ---------------------------------------------------------------------------------------------
# The commands
# ---------------------------------------------------------------------------------------------


def test_check_takes_an_id(tiny_repo, capsys):
    code, out, err = run_cli(capsys, "check", "test-org/tiny-llama")
    assert code == 0, err
    assert re.search(r"^model\s+test-org/tiny-llama$", out, re.MULTILINE)
    assert "2 layers, hidden 128" in out


def test_an_uncached_id_is_one_line(hub, capsys):
    code, _, err = run_cli(capsys, "check", "test-org/not-cached")
    line = one_line_error(code, err)
    assert "'test-org/not-cached' is not in the Hugging Face cache" in line
    assert "HF_HUB_OFFLINE" in line and "`hf download test-org/not-cached`" in line


def test_bench_takes_an_id_for_its_tokenizer(tiny_repo):
    from lmstack_bench.cli import UsageError, _tokenizer

    snapshot = tiny_repo / "models--test-org--tiny-llama" / "snapshots" / COMMIT_A
    expected = model_source.open_model_source(str(snapshot)).tokenizer.encode("the cat")
    assert _tokenizer("test-org/tiny-llama").encode("the cat") == expected
    with pytest.raises(UsageError, match="'test-org/not-cached' is not in the Hugging Face cache"):
        _tokenizer("test-org/not-cached")


def test_serve_an_id(tiny_repo):
    from lmstack_api.testing import ServerProcess

    server = ServerProcess({})
    # The model alone, every default but the one key set over it.
    server.serve_args = ["test-org/tiny-llama", "--host", "127.0.0.1", "--port", str(server.port)]
    server.serve_args += ["--set", "scheduler.max_num_seqs=5"]
    with server:
        status, completion, _ = server.post("/v1/completions", {"prompt": "the cat", "max_tokens": 4})
        assert status == 200, completion
        assert completion["model"] == "test-org/tiny-llama"
        assert completion["usage"]["completion_tokens"] == 4
        status, body = server.get("/v1/models")
        assert status == 200 and b'"test-org/tiny-llama"' in body
        stack = json.loads(server.get("/v1/stack")[1])
        assert stack["model"] == "test-org/tiny-llama"
        assert stack["stack"]["components"]["scheduler"]["options"]["max_num_seqs"] == 5


# ---------------------------------------------------------------------------------------------
# Downloads, through a stand-in for the Hub's HTTP API
# ---------------------------------------------------------------------------------------------


class FakeHub:
    """The part of the Hub's HTTP API huggingface_hub's downloads use (repository info, file
    tree, HEAD / GET of /resolve/), with the error codes the Hub sends: a gated repository (403
    GatedRepo, unless the request carries `token`), a missing one (401 RepoNotFound), a missing
    revision or file."""

    def __init__(self, repos: dict[str, tuple[str, dict[str, bytes]]], gated: dict[str, str]) -> None:
        self.repos, self.gated = repos, gated
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, head=True)

            def do_GET(self) -> None:
                hub.answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        parts = unquote(urlparse(h.path).path).strip("/").split("/")
        api = parts[:2] == ["api", "models"]
        if api:
            parts = parts[2:]
        repo, rest = "/".join(parts[:2]), parts[2:]
        token = self.gated.get(repo)
        if token is not None and h.headers.get("Authorization") != f"Bearer {token}":
            return self.send(h, 403, {"error": "gated"}, head, "GatedRepo")
        if repo not in self.repos:
            return self.send(h, 401, {"error": "Repository not found"}, head, "RepoNotFound")
        commit, files = self.repos[repo]
        revision = rest[1] if len(rest) > 1 else "main"
        if revision not in ("main", commit):
            return self.send(h, 404, {"error": "Revision not found"}, head, "RevisionNotFound")
        if api and rest[:1] in ([], ["revision"]):
            return self.send(
                h, 200, {"id": repo, "sha": commit, "siblings": [{"rfilename": f} for f in files]}, head
            )
        if api and rest[:1] == ["tree"]:
            tree = [
                {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for f, b in files.items()
            ]
            return self.send(h, 200, tree, head)
        name = "/".join(rest[2:])
        if rest[:1] == ["resolve"] and name in files:
            etag = '"' + hashlib.sha256(files[name]).hexdigest() + '"'
            return self.send(h, 200, files[name], head, headers={"X-Repo-Commit": commit, "ETag": etag})
        return self.send(h, 404, {"error": "Entry not found"}, head, "EntryNotFound")

    @staticmethod
    def send(h, status: int, body, head: bool, code: str | None = None, headers: dict | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h.send_response(status)
        for key, value in {**(headers or {}), **({"X-Error-Code": code} if code else {})}.items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if not head:
            h.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub(tmp_path):
    files = tiny_model_files(tmp_path / "tiny")
    files |= {"original/params.json": b"{}", "tiny-Q8_0.gguf": b"GGUF q8_0 bytes", "README.md": b"# tiny"}
    hub = FakeHub(
        {"test-org/tiny-llama": (COMMIT_A, files), "test-org/gated": (COMMIT_B, files)},
        gated={"test-org/gated": "hf_test_token"},
    )
    yield hub
    hub.close()


def resolve_online(hub: FakeHub, hf_home: Path, names: list[str], token: str | None = None) -> list[str]:
    """Each name resolved in a fresh process (huggingface_hub reads HF_ENDPOINT when imported),
    online: the resolved path's part under HF_HOME, or the error."""
    script = (
        "import sys\n"
        "from lmstack.errors import ConfigError\n"
        "from lmstack.model.source import resolve_model_path\n"
        "for name in sys.argv[1:]:\n"
        "    try: print(resolve_model_path(name).relative_to(" + repr(str(hf_home)) + "))\n"
        "    except ConfigError as exc: print(exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(hf_home),
        **({"HF_TOKEN": token} if token else {}),
    }
    done = subprocess.run(
        [sys.executable, "-c", script, *names], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_an_uncached_id_is_downloaded_into_the_cache_then_read_offline(fake_hub, tmp_path, monkeypatch):
    home = tmp_path / "hf"
    folder, gguf = resolve_online(fake_hub, home, ["test-org/tiny-llama", "test-org/tiny-llama:Q8_0"])
    snapshot = f"hub/models--test-org--tiny-llama/snapshots/{COMMIT_A}"
    assert (folder, gguf) == (snapshot, f"{snapshot}/tiny-Q8_0.gguf")
    # What a Hugging Face folder needs, no more: no subfolders, no other files.
    downloaded = {
        p.relative_to(home / snapshot).as_posix() for p in (home / snapshot).rglob("*") if p.is_file()
    }
    assert downloaded == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "tiny-Q8_0.gguf",
    }
    # Offline now, the same id is the same cached folder.
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(model_source, "_hub_resolved", {})
    assert resolve_model_path("test-org/tiny-llama") == home / snapshot


def test_what_the_hub_refuses_is_one_line_saying_what_to_do(fake_hub, tmp_path):
    gated, missing, revision, file = resolve_online(
        fake_hub,
        tmp_path / "hf",
        ["test-org/gated", "test-org/missing", "test-org/tiny-llama@v9", "test-org/tiny-llama/other.gguf"],
    )
    assert gated == (
        "model 'test-org/gated' is gated on the Hugging Face Hub: accept its terms on its page, then log in "
        "with `hf auth login` or set HF_TOKEN"
    )
    assert missing.startswith(
        "model 'test-org/missing': no such local file or folder, and no repository test-org/missing on "
        "the Hugging Face Hub; check the id"
    )
    assert (
        revision
        == "model 'test-org/tiny-llama@v9': test-org/tiny-llama has no revision 'v9'; check the branch, tag or commit"
    )
    assert (
        file
        == "model 'test-org/tiny-llama/other.gguf': test-org/tiny-llama has no file 'other.gguf'; check the file name"
    )


def test_hf_token_opens_a_gated_repository(fake_hub, tmp_path):
    (folder,) = resolve_online(fake_hub, tmp_path / "hf", ["test-org/gated"], token="hf_test_token")
    assert folder == f"hub/models--test-org--gated/snapshots/{COMMIT_B}"
