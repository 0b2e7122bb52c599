"""The one configuration object: OffloadingConfig.load over overrides, KVOFF_* environment
variables, JSON/YAML files and defaults; from_dict; byte units; error messages; the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

import kvoff
from kvoff.config import ConfigError, OffloadingConfig, parse_byte_size
from kvoff.tools.cli import parse_bytes

FIELDS = tuple(OffloadingConfig.model_fields)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVOFF_* configuration variable of the caller leaks into these tests."""
    for name in list(os.environ):
        if name.upper() == "KVOFF_CONFIG_FILE" or name.upper() in {
            f"KVOFF_{f.upper()}" for f in FIELDS
        }:
            monkeypatch.delenv(name)


def _yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_fields_and_defaults() -> None:
    cfg = OffloadingConfig(num_cpu_blocks=8)
    assert cfg.world_size == 1
    assert cfg.hash_block_size is None
    assert cfg.enable_events is False
    assert cfg.pin_memory is None
    assert cfg.resolve_pin_memory() in (True, False)
    assert OffloadingConfig(num_cpu_blocks=8, pin_memory="auto").pin_memory is None
    assert OffloadingConfig(num_cpu_blocks=8, pin_memory=False).resolve_pin_memory() is False
    assert kvoff.OffloadingConfig is OffloadingConfig
    with pytest.raises(pydantic.ValidationError, match="greater than 0"):
        OffloadingConfig(num_cpu_blocks=8, world_size=0)
    with pytest.raises(pydantic.ValidationError, match="hash_block_size=48"):
        OffloadingConfig(num_cpu_blocks=8, offloaded_block_size=64, hash_block_size=48)
    assert OffloadingConfig(num_cpu_blocks=8, offloaded_block_size=64, hash_block_size=32)


def test_world_size_field_sizes_the_pool() -> None:
    cfg = OffloadingConfig(cpu_bytes_to_use=2**30, offloaded_block_size=64, world_size=4)
    assert cfg.resolve_num_cpu_blocks(4096, 16) == 2**30 // (4096 * 4 * 4)
    assert cfg.resolve_num_cpu_blocks(4096, 16, world_size=1) == 2**30 // (4096 * 4)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("512MiB", 512 * 2**20),
        ("40GiB", 40 * 2**30),
        ("40 gib", 40 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("2k", 2000),
        ("1TiB", 2**40),
    ],
)
def test_byte_units(text: str, value: int) -> None:
    assert parse_byte_size(text) == value
    assert parse_bytes(text) == value  # the CLI's argparse type, still importable
    assert OffloadingConfig(cpu_bytes_to_use=text).cpu_bytes_to_use == value
    assert OffloadingConfig.from_dict({"cpu_bytes_to_use": text}).cpu_bytes_to_use == value


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "0GiB", "-1", ""])
def test_bad_byte_counts(text: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="cpu_bytes_to_use"):
        OffloadingConfig(cpu_bytes_to_use=text)


def test_constructor_does_not_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFF_NUM_CPU_BLOCKS", "5")
    monkeypatch.setenv("KVOFF_ENABLE_EVENTS", "true")
    cfg = OffloadingConfig(cpu_bytes_to_use=100)
    assert cfg.num_cpu_blocks is None and cfg.enable_events is False
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        OffloadingConfig()
    assert OffloadingConfig.from_dict({"cpu_bytes_to_use": 100}) == cfg
    # load() reads it, unless env=False
    assert OffloadingConfig.load().num_cpu_blocks == 5
    assert OffloadingConfig.load(env=False, cpu_bytes_to_use=100) == cfg


def test_precedence_each_level_overrides_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = _yaml(
        tmp_path / "c.yaml",
        "cpu_bytes_to_use: 1GiB\noffloaded_block_size: 64\nworld_size: 2\nenable_events: true\n",
    )
    # file > defaults
    cfg = OffloadingConfig.load(f)
    assert (cfg.cpu_bytes_to_use, cfg.offloaded_block_size, cfg.world_size) == (2**30, 64, 2)
    assert cfg.enable_events is True and cfg.eviction_policy == "lru"
    # env > file
    monkeypatch.setenv("KVOFF_OFFLOADED_BLOCK_SIZE", "128")
    monkeypatch.setenv("KVOFF_WORLD_SIZE", "4")
    monkeypatch.setenv("KVOFF_PIN_MEMORY", "false")
    cfg = OffloadingConfig.load(f)
    assert (cfg.offloaded_block_size, cfg.world_size, cfg.pin_memory) == (128, 4, False)
    assert cfg.cpu_bytes_to_use == 2**30 and cfg.enable_events is True
    # overrides > env > file
    cfg = OffloadingConfig.load(f, world_size=8, enable_events=False)
    assert (cfg.offloaded_block_size, cfg.world_size, cfg.enable_events) == (128, 8, False)
    # the caller's defaults sit below everything
    cfg = OffloadingConfig.load(f, defaults={"world_size": 16, "hash_block_size": 32})
    assert (cfg.world_size, cfg.hash_block_size) == (4, 32)


def test_pool_size_comes_from_one_level(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = _yaml(tmp_path / "c.yml", "cpu_bytes_to_use: 40GiB\n")
    monkeypatch.setenv("KVOFF_NUM_CPU_BLOCKS", "1000")
    cfg = OffloadingConfig.load(f)
    assert (cfg.num_cpu_blocks, cfg.cpu_bytes_to_use) == (1000, None)
    cfg = OffloadingConfig.load(f, cpu_bytes_to_use="8GiB")
    assert (cfg.num_cpu_blocks, cfg.cpu_bytes_to_use) == (None, 8 * 2**30)
    assert OffloadingConfig.load(env=False, defaults={"cpu_bytes_to_use": 7}).cpu_bytes_to_use == 7
    assert OffloadingConfig.load(defaults={"cpu_bytes_to_use": 7}).num_cpu_blocks == 1000
    # one level that sets both is still an error, naming where they came from
    monkeypatch.setenv("KVOFF_CPU_BYTES_TO_USE", "1GiB")
    with pytest.raises(ConfigError, match=r"exactly one.*KVOFF_NUM_CPU_BLOCKS"):
        OffloadingConfig.load(f)


def test_json_and_yaml_files(tmp_path: Path) -> None:
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"num_cpu_blocks": 64, "eviction_policy": "LRU", "pin_memory": True}))
    y = _yaml(tmp_path / "c.yaml", "num_cpu_blocks: 64\neviction_policy: LRU\npin_memory: true\n")
    assert OffloadingConfig.load(j) == OffloadingConfig.load(str(y))
    assert OffloadingConfig.load(j) == OffloadingConfig(
        num_cpu_blocks=64, eviction_policy="lru", pin_memory=True
    )
    with pytest.raises(ConfigError, match=r"unsupported suffix '\.toml'"):
        OffloadingConfig.load(tmp_path / "c.toml")
    with pytest.raises(FileNotFoundError, match=r"missing\.yaml"):
        OffloadingConfig.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{num_cpu_blocks: 1")
    with pytest.raises(ConfigError, match=r"bad\.json.*not JSON"):
        OffloadingConfig.load(bad)
    listy = _yaml(tmp_path / "list.yaml", "- num_cpu_blocks\n")
    with pytest.raises(ConfigError, match=r"list\.yaml.*mapping"):
        OffloadingConfig.load(listy)


def test_config_file_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = _yaml(tmp_path / "env.yaml", "num_cpu_blocks: 11\n")
    arg_file = _yaml(tmp_path / "arg.yaml", "num_cpu_blocks: 22\n")
    monkeypatch.setenv("KVOFF_CONFIG_FILE", str(env_file))
    assert OffloadingConfig.load().num_cpu_blocks == 11
    assert OffloadingConfig.load(arg_file).num_cpu_blocks == 22  # the argument wins
    with pytest.raises(ConfigError, match="exactly one"):
        OffloadingConfig.load(env=False)  # env=False ignores KVOFF_CONFIG_FILE too
    monkeypatch.setenv("KVOFF_CONFIG_FILE", str(tmp_path / "gone.yaml"))
    with pytest.raises(FileNotFoundError, match=r"gone\.yaml"):
        OffloadingConfig.load()


def test_unknown_keys_name_the_key_the_source_and_a_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'cpu_byte_to_use'.*did you mean 'cpu_bytes_to_use'"):
        OffloadingConfig.from_dict({"cpu_byte_to_use": "1GiB"})
    with pytest.raises(ConfigError, match=r"'eviction'.*did you mean 'eviction_policy'"):
        OffloadingConfig.load(num_cpu_blocks=1, eviction="lru")
    f = _yaml(tmp_path / "typo.yaml", "num_cpu_blocks: 4\nenable_event: true\n")
    with pytest.raises(ConfigError, match=r"'enable_event'.*typo\.yaml.*'enable_events'"):
        OffloadingConfig.load(f)
    j = tmp_path / "typo.json"
    j.write_text('{"num_cpu_blocks": 4, "pin": true}')
    with pytest.raises(ConfigError, match=r"'pin'.*typo\.json.*'pin_memory'"):
        OffloadingConfig.load(j)
    # the usual pydantic errors for bad values
    with pytest.raises(pydantic.ValidationError, match="world_size"):
        OffloadingConfig.from_dict({"num_cpu_blocks": 4, "world_size": "two"})
    with pytest.raises(ConfigError, match="mapping"):
        OffloadingConfig.from_dict([("num_cpu_blocks", 4)])  # type: ignore[arg-type]


def test_bad_values_name_their_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFF_EVICTION_POLICY", "fifo")
    with pytest.raises(ConfigError, match=r"environment variable KVOFF_EVICTION_POLICY.*'fifo'"):
        OffloadingConfig.load(num_cpu_blocks=4)
    monkeypatch.delenv("KVOFF_EVICTION_POLICY")
    monkeypatch.setenv("KVOFF_CPU_BYTES_TO_USE", "lots")
    with pytest.raises(ConfigError, match=r"KVOFF_CPU_BYTES_TO_USE.*not a byte count"):
        OffloadingConfig.load()
    monkeypatch.delenv("KVOFF_CPU_BYTES_TO_USE")
    monkeypatch.setenv("KVOFF_ENABLE_EVENTS", "maybe")
    with pytest.raises(ConfigError, match="KVOFF_ENABLE_EVENTS"):
        OffloadingConfig.load(num_cpu_blocks=4)
    monkeypatch.delenv("KVOFF_ENABLE_EVENTS")
    f = _yaml(tmp_path / "w.yaml", "num_cpu_blocks: 4\nworld_size: 0\n")
    with pytest.raises(ConfigError, match=r"world_size=0 \(from file .*w\.yaml"):
        OffloadingConfig.load(f)
    with pytest.raises(ConfigError, match=r"world_size=-1 \(from the arguments"):
        OffloadingConfig.load(f, world_size=-1)
    # a ConfigError is a ValueError, and chains the pydantic error
    try:
        OffloadingConfig.load(f)
    except ValueError as exc:
        assert isinstance(exc.__cause__, pydantic.ValidationError)


def _replay(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    out = tmp_path / "out.json"
    base = {
        k: v
        for k, v in os.environ.items()
        if not (k.upper().startswith("KVOFF_") and k.upper() != "KVOFF_ENABLE_CUDA")
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvoff",
            "replay",
            "--limit=20",
            "--no-progress",
            "--json",
            out,
            *args,
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**base, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())["result"]


@pytest.mark.slow
def test_cli_config_file_env_and_flags(tmp_path: Path) -> None:
    f = _yaml(tmp_path / "f.yaml", "num_cpu_blocks: 123\neviction_policy: lru\n")
    assert _replay(tmp_path, "--config", str(f))["cpu_blocks"] == 123
    # KVOFF_* variables override the file; flags override both
    env = {"KVOFF_NUM_CPU_BLOCKS": "77"}
    assert _replay(tmp_path, "--config", str(f), env=env)["cpu_blocks"] == 77
    assert _replay(tmp_path, "--config", str(f), "--cpu-blocks", "55", env=env)["cpu_blocks"] == 55
    # nothing anywhere: the 2 GiB default pool (tiny model: 2 GiB / (16 KiB per 512-token block))
    default = _replay(tmp_path)
    assert default["offloaded_block_size"] == 512
    assert default["cpu_pool_bytes"] <= 2 * 2**30 < default["cpu_pool_bytes"] * 2
    assert _replay(tmp_path, env={"KVOFF_CONFIG_FILE": str(f)})["cpu_blocks"] == 123


def test_cli_config_errors(tmp_path: Path) -> None:
    f = _yaml(tmp_path / "bad.yaml", "num_cpu_block: 10\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvoff", "replay", "--limit", "1", "--config", str(f)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "'num_cpu_block'" in proc.stderr and "bad.yaml" in proc.stderr
    assert "'num_cpu_blocks'" in proc.stderr


def test_tier_keys_are_checked_together() -> None:
    cfg = OffloadingConfig(num_cpu_blocks=8, disk_path="/tmp/kvoff-disk", disk_bytes="2GiB")
    assert cfg.has_tiers and cfg.disk_bytes == 2 << 30 and cfg.remote_url is None
    assert not OffloadingConfig(num_cpu_blocks=8).has_tiers
    assert OffloadingConfig(num_cpu_blocks=8, remote_url="redis://h:7000").has_tiers
    bad = [
        ({"disk_path": "/tmp/x"}, "disk_bytes"),
        ({"disk_bytes": "1GiB"}, "disk_path"),
        ({"remote_url": "http://h:7000"}, "redis://host:port"),
        # the tier's own URL check, at configuration time (not at engine start)
        ({"remote_url": "redis://127.0.0.1:notaport"}, "bad node '127.0.0.1:notaport'"),
        ({"remote_url": "redis://h"}, "needs host:port"),
        ({"remote_url": "redis://h:7000", "remote_namespace": "a b"}, "remote_namespace"),
        ({"remote_url": "redis://h:7000", "remote_timeout_s": 0}, "greater than 0"),
        ({"tier_write_queue_blocks": 0}, "tier_write_queue_blocks"),
    ]
    for kwargs, needle in bad:
        with pytest.raises(pydantic.ValidationError, match=needle):
            OffloadingConfig(num_cpu_blocks=8, **kwargs)


def test_replay_takes_its_tiers_from_the_environment(tmp_path: Path) -> None:
    env = {"KVOFF_DISK_PATH": str(tmp_path / "disk"), "KVOFF_DISK_BYTES": "64MiB"}
    out = _replay(tmp_path, "--cpu-blocks", "16", env=env)
    assert out["tiers"]["tiers"]["disk"]["written_blocks"] > 0
    assert (tmp_path / "disk" / "kvoff-blocks.slots").is_file()
