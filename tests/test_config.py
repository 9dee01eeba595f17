"""The stack file: parsing, normalisation, and errors that name the key path."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmstack.errors import ConfigError
from lmstack.stack.config import (
    CORE_KEYS,
    KV_CACHE_AUTO,
    StackConfig,
    convert,
    load_stack,
    parse_stack,
)
from lmstack.stack.plugins import build_registry, make_plugin_manager
from lmstack.stack.resolve import resolve
from lmstack_api.config import ServerConfig

# The built-ins and lmstack-api's plugin (which declares `server:`), nothing else installed:
# errors in plugin-declared sections surface when the stack is resolved.
REGISTRY = build_registry(make_plugin_manager(autoload=False, extra_plugins=["lmstack_api.plugin"]))


def checked(source):
    """Parse and resolve (no device check, no model): where every key is validated."""
    stack = source if isinstance(source, StackConfig) else load_stack(source)
    return resolve(stack, REGISTRY, check_device=False)


DESIGN_EXAMPLE = """\
model: smollm2-135m-instruct        # a known name, a .gguf file, or a Hugging Face model folder
dtype: bfloat16
device: cpu
scheduler: {name: continuous, max_num_seqs: 64, max_num_batched_tokens: 2048}
allocator: {name: paged, block_size: 16, kv_cache_memory: 2GiB}
cache: {name: tiered, disk_path: /var/cache/lmstack, disk_capacity: 20GiB}
attention: {prefill: torch, decode: torch}
quant: {weights: none, kv_cache: none}
speculator: {name: ngram, num_draft_tokens: 5}
parallel: {tp: 1, pp: 1, ep: 1}
server: {host: 127.0.0.1, port: 8000}
"""


def error(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        resolve(parse_stack(text, "stack.yaml"), REGISTRY, check_device=False)
    return info.value


# ---------------------------------------------------------------------------------------------
# Defaults and accepted forms
# ---------------------------------------------------------------------------------------------


def test_empty_stack_gives_the_defaults():
    for stack in (load_stack({}), parse_stack(""), parse_stack("# only a comment\n")):
        assert stack == StackConfig()
        assert stack.model == "smollm2-135m-instruct"
        assert stack.dtype == "auto"
        assert stack.device == "auto"
        assert stack.scheduler == {"name": "continuous"}
        assert stack.allocator == {"name": "paged"}
        assert stack.attention == {"prefill": {"name": "auto"}, "decode": {"name": "auto"}}
        assert stack.quant == {"weights": "auto", "kv_cache": KV_CACHE_AUTO}
        assert stack.speculator == {"name": "none"}
        assert stack.parallel == {"name": "single"}
        assert stack.cache == {"name": "auto"}
        assert stack.extra_sections == {}
        assert checked(stack).sections["server"] == ServerConfig(host="127.0.0.1", port=8000)


def test_the_design_example_parses():
    stack = parse_stack(DESIGN_EXAMPLE)
    assert stack.scheduler == {"name": "continuous", "max_num_seqs": 64, "max_num_batched_tokens": 2048}
    assert stack.allocator == {"name": "paged", "block_size": 16, "kv_cache_memory": "2GiB"}
    assert stack.cache == {"name": "tiered", "disk_path": "/var/cache/lmstack", "disk_capacity": "20GiB"}
    assert stack.quant == {"weights": "none", "kv_cache": "none"}
    assert stack.speculator == {"name": "ngram", "num_draft_tokens": 5}
    # A section without `name` gets its default component; layout options stay.
    assert stack.parallel == {"name": "single", "tp": 1, "pp": 1, "ep": 1}


def test_load_stack_reads_a_file(tmp_path):
    path = tmp_path / "stack.yaml"
    path.write_text("dtype: float32\nscheduler: {max_num_seqs: 4}\n")
    stack = load_stack(path)
    assert stack.dtype == "float32"
    assert stack.scheduler == {"name": "continuous", "max_num_seqs": 4}
    assert load_stack(str(path)) == stack


def test_the_stack_is_immutable():
    stack = load_stack({})
    with pytest.raises(AttributeError):
        stack.dtype = "float32"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("flash", {"prefill": {"name": "flash"}, "decode": {"name": "flash"}}),
        (
            {"name": "flash", "num_warps": 4},
            {p: {"name": "flash", "num_warps": 4} for p in ("prefill", "decode")},
        ),
        (
            {"prefill": "flash", "decode": "torch"},
            {"prefill": {"name": "flash"}, "decode": {"name": "torch"}},
        ),
        ({"prefill": "flash"}, {"prefill": {"name": "flash"}, "decode": {"name": "auto"}}),
        (
            {"prefill": {"name": "flash", "num_warps": 8}, "decode": "paged-decode"},
            {"prefill": {"name": "flash", "num_warps": 8}, "decode": {"name": "paged-decode"}},
        ),
        (None, {"prefill": {"name": "auto"}, "decode": {"name": "auto"}}),
    ],
)
def test_attention_forms(value, expected):
    assert load_stack({"attention": value}).attention == expected


def test_named_section_short_forms():
    stack = load_stack({"scheduler": "priority", "speculator": None, "allocator": {"block_size": 32}})
    assert stack.scheduler == {"name": "priority"}
    assert stack.speculator == {"name": "none"}
    assert stack.allocator == {"name": "paged", "block_size": 32}


def test_quant_forms():
    assert load_stack({"quant": "fp8"}).quant == {"weights": "fp8", "kv_cache": "auto"}
    assert load_stack({"quant": {"kv_cache": "float8_e4m3fn"}}).quant == {
        "weights": "auto",
        "kv_cache": "float8_e4m3fn",
    }
    assert load_stack({"quant": {"weights": "awq", "group_size": 128}}).quant == {
        "weights": "awq",
        "group_size": 128,
        "kv_cache": "auto",
    }
    # YAML `kv_cache: null` means "no KV-cache quantization".
    assert parse_stack("quant: {kv_cache: null}").quant["kv_cache"] == "none"


def test_cache_section_names_a_cache_component():
    assert parse_stack("cache:\n").cache == {"name": "auto"}
    assert parse_stack("cache: prefix").cache == {"name": "prefix"}
    assert parse_stack("cache: {name: tiered, disk_path: /tmp/kv}").cache == {
        "name": "tiered",
        "disk_path": "/tmp/kv",
    }


# ---------------------------------------------------------------------------------------------
# Errors name the key path
# ---------------------------------------------------------------------------------------------


def test_unknown_top_level_key():
    e = error("model: x\nshceduler: {name: continuous}\n")
    assert e.path == "shceduler"
    assert "unknown key; did you mean 'scheduler'?" in str(e)
    assert "server" in str(e)  # lists what is accepted, plugin sections included


def test_plugin_sections_are_kept_raw_until_resolved():
    stack = load_stack({"server": {"port": 9000}, "telemetry": {"on": True}})
    assert stack.extra_sections == {"server": {"port": 9000}, "telemetry": {"on": True}}
    with pytest.raises(ConfigError) as info:
        checked(stack)
    assert info.value.path == "telemetry"  # nobody declares it
    assert checked({"server": {"port": 9000}}).sections["server"].port == 9000
    # Without lmstack-api's plugin, `server:` is as unknown as any other key.
    bare = build_registry(make_plugin_manager(autoload=False))
    with pytest.raises(ConfigError, match="unknown key") as info:
        resolve(load_stack({"server": {"port": 9000}}), bare)
    assert info.value.path == "server"


def test_section_view_hides_secrets():
    keys = ["sk-secret-1", {"key": "sk-secret-2", "tenant": "acme"}]
    described = checked({"server": {"api_keys": keys}}).describe()
    assert "sk-secret" not in str(described)
    assert described["server"]["api_keys"] == "2 configured"


def test_api_key_tenants():
    from lmstack_api.config import key_tenant, key_tenants

    cfg = checked({"server": {"api_keys": ["sk-a", {"key": "sk-b", "tenant": "acme"}]}}).sections["server"]
    derived = key_tenant("sk-a")
    assert derived == "key-" + hashlib.sha256(b"sk-a").hexdigest()[:12] and "sk-a" not in derived
    assert key_tenants(cfg, ["sk-env"]) == [
        ("sk-a", derived),
        ("sk-b", "acme"),
        ("sk-env", key_tenant("sk-env")),
    ]
    e = error("server: {api_keys: [{key: sk-a, tenant: 'two words'}]}")
    assert e.path == "server.api_keys[0].tenant"
    e = error("server: {api_keys: [sk-a, {key: sk-a, tenant: acme}]}")
    assert "one key twice" in str(e) and "'acme'" in str(e) and "sk-a" not in str(e)


def test_unknown_nested_key():
    e = error("server: {host: 0.0.0.0, prot: 80}\n")
    assert e.path == "server.prot"
    assert str(e).startswith("server.prot: unknown key")
    assert "host, port" in str(e)


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        ("server: {port: eighty}", "server.port", "expected int, got str"),
        ("model: 7", "model", "expected str"),
        ("max_model_len: 2k", "max_model_len", "expected int"),
        ("server: 8000", "server", "expected a mapping"),
        ("scheduler: [continuous]", "scheduler", "expected a mapping"),
        ("scheduler: {name: 3}", "scheduler.name", "expected a component name"),
        ("attention: {prefill: {name: 5}}", "attention.prefill.name", "expected a component name"),
        ("cache: [prefix]", "cache", "expected a mapping"),
    ],
)
def test_wrong_type(text, path, fragment):
    e = error(text)
    assert e.path == path
    assert fragment in str(e)


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        ("seed: -1", "seed", "-1"),
        ("max_model_len: 0", "max_model_len", ">= 1"),
        ("server: {port: -5}", "server.port", "-5"),
        ("server: {port: 70000}", "server.port", "<= 65535"),
        ("dtype: bf16", "dtype", "float32, float16, bfloat16"),
        ("quant: {kv_cache: int3}", "quant.kv_cache", "float8_e4m3fn"),
        ("device: gpu0", "device", "not a torch device"),
        ("attention: {prefil: flash}", "attention.prefil", "prefill and decode"),
        ("attention: {name: flash, decode: torch}", "attention.decode", "not both"),
        ("cache: {name: 3}", "cache.name", "expected a component name"),
    ],
)
def test_bad_value(text, path, fragment):
    e = error(text)
    assert e.path == path
    assert fragment in str(e)
    assert "\n" not in str(e)


def test_malformed_yaml_names_the_line():
    e = error("model: smollm2-135m-instruct\nscheduler: {name: continuous,\nallocator: paged\n")
    assert "stack.yaml:" in str(e) and "invalid YAML" in str(e)
    line = int(str(e).split("stack.yaml:")[1].split(":")[0])
    assert line >= 3  # the flow mapping opened on line 2 is unterminated further down
    e = error("model: x\n  dtype: float32\n")
    assert "stack.yaml:2:" in str(e)


def test_duplicate_keys_are_errors():
    e = error("scheduler: {name: continuous}\ndtype: float32\nscheduler: {name: priority}\n")
    assert "duplicate key 'scheduler'" in str(e)
    assert "stack.yaml:3:" in str(e) and "line 1" in str(e)


def test_a_stack_must_be_a_mapping():
    assert "must be a mapping" in str(error("- model: x\n"))
    assert "must be a mapping" in str(error("just a string\n"))


def test_missing_or_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="stack file not found"):
        load_stack(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_stack(tmp_path)


def test_non_string_keys():
    with pytest.raises(ConfigError, match="keys must be strings"):
        load_stack({1: "x"})
    with pytest.raises(ConfigError) as info:
        parse_stack("scheduler: {1: 2}")
    assert info.value.path == "scheduler"


@given(st.from_regex(r"[a-z][a-z_]{0,15}", fullmatch=True))
def test_any_unknown_top_level_key_is_named(key):
    if key in CORE_KEYS or key == "server":
        return
    with pytest.raises(ConfigError) as info:
        checked({key: 1})
    assert info.value.path == key


# ---------------------------------------------------------------------------------------------
# convert(): msgspec paths rewritten into ours
# ---------------------------------------------------------------------------------------------


class Tier(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    capacity: int = 0


class TieredOptions(msgspec.Struct, forbid_unknown_fields=True):
    tiers: list[Tier] = []
    mode: str = "lru"


def test_convert_rewrites_nested_paths():
    with pytest.raises(ConfigError) as info:
        convert({"tiers": [{"name": "host"}, {"name": "disk", "capacity": "big"}]}, TieredOptions, "cache")
    assert info.value.path == "cache.tiers[1].capacity"
    assert "expected int, got str" in str(info.value)

    with pytest.raises(ConfigError) as info:
        convert({"tiers": [{"name": "host", "size": 1}]}, TieredOptions, "cache")
    assert info.value.path == "cache.tiers[0].size"
    assert "name, capacity" in str(info.value)

    with pytest.raises(ConfigError) as info:
        convert({"tiers": [{}]}, TieredOptions, "cache")
    assert info.value.path == "cache.tiers[0].name"
    assert "required" in str(info.value)


def test_convert_names_the_owner_of_unknown_options():
    with pytest.raises(ConfigError) as info:
        convert({"mdoe": "lfu"}, TieredOptions, "cache", owner="cache 'tiered'")
    assert str(info.value) == "cache.mdoe: unknown key; cache 'tiered' accepts: tiers, mode"
