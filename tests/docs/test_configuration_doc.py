"""docs/configuration.md against the code: its table of keys holds every ``OffloadingConfig``
field and no other key, each with the field's default; its table of bad values holds every
field too, and each bad value raises an error that says what the page says."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from docs_text import ROOT

from kvoff import OffloadingConfig
from kvoff.config import ConfigError, parse_byte_size

PAGE = ROOT / "docs" / "configuration.md"
FIELDS = tuple(OffloadingConfig.model_fields)


def _table(header: str) -> list[list[str]]:
    """The rows (cells, stripped) of the Markdown table whose header row starts with ``header``."""
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _span(cell: str) -> str:
    """The first inline code span of a cell."""
    m = re.search(r"`([^`]*)`", cell)
    assert m, f"no code span in {cell!r}"
    return m.group(1)


KEYS = {_span(row[0]): row for row in _table("| key | unit | default |")}
BAD = {_span(row[0]): row for row in _table("| key | a bad value |")}


def _documented_default(text: str, default: Any) -> bool:
    """Whether the page's default ``text`` (``none``, ``true``, ``0.25``, ``64MiB``, ``lru``)
    is the field's ``default``."""
    if text == "none":
        return default is None
    if text in ("true", "false"):
        return default is (text == "true")
    if isinstance(default, bool) or default is None:
        return False
    if isinstance(default, (int, float)):
        try:
            return float(text) == default
        except ValueError:
            return isinstance(default, int) and parse_byte_size(text) == default
    return text == default


def test_every_key_is_documented_once_and_no_other() -> None:
    rows = [_span(row[0]) for row in _table("| key | unit | default |")]
    assert len(rows) == len(set(rows)), "a key documented twice"
    assert set(rows) == set(FIELDS), (
        f"missing: {sorted(set(FIELDS) - set(rows))}; not keys: {sorted(set(rows) - set(FIELDS))}"
    )
    assert set(BAD) == set(FIELDS), (
        f"bad values missing for {sorted(set(FIELDS) - set(BAD))}; "
        f"not keys: {sorted(set(BAD) - set(FIELDS))}"
    )


@pytest.mark.parametrize("key", FIELDS)
def test_the_documented_default_is_the_code_default(key: str) -> None:
    row = KEYS[key]
    assert all(row), f"{key}: an empty cell in {row}"
    default = OffloadingConfig.model_fields[key].default
    assert _documented_default(_span(row[2]), default), (
        f"{key}: the page says {row[2]!r}, the code's default is {default!r}"
    )


@pytest.mark.parametrize("key", FIELDS)
def test_the_documented_bad_value_raises_the_documented_error(key: str) -> None:
    _, value_cell, error_cell = BAD[key]
    value = json.loads(_span(value_cell))
    config: dict[str, Any] = {key: value}
    if key not in ("cpu_bytes_to_use", "num_cpu_blocks"):
        config["num_cpu_blocks"] = 1000
    with pytest.raises((ValueError, ConfigError)) as info:
        OffloadingConfig.from_dict(config)
    assert _span(error_cell) in str(info.value), str(info.value)
    if key != "transfer_thresholds":  # in the environment any text is a path (the page says)
        # the same value from the environment names the variable it came from
        variable = f"KVOFF_{key.upper()}"
        assert variable in _env_error(key, value), variable


def _env_error(key: str, value: Any) -> str:
    """The error of :meth:`OffloadingConfig.load` for ``value`` in ``KVOFF_<KEY>``."""
    text = value if isinstance(value, str) else json.dumps(value)
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv(f"KVOFF_{key.upper()}", text)
        mp.delenv("KVOFF_CONFIG_FILE", raising=False)
        size = {} if key in ("cpu_bytes_to_use", "num_cpu_blocks") else {"num_cpu_blocks": 1000}
        with pytest.raises(ConfigError) as info:
            OffloadingConfig.load(**size)
        return str(info.value)
    finally:
        mp.undo()
