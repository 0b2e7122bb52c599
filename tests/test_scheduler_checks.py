"""The scheduler hooks' argument checks (kvoff.scheduler_checks), called directly: each accepts
what an engine passes and refuses, naming the value, what the C++ core would misread."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from kvoff.scheduler_checks import check_count, job_report, key_bytes, token_count


def test_token_count_takes_ints_and_index_types_and_refuses_the_rest() -> None:
    assert token_count("n", 7) == 7
    assert token_count("n", np.int64(-3)) == -3
    assert token_count("n", 2**63 - 1) == 2**63 - 1
    with pytest.raises(TypeError, match=r"num_computed_tokens must be an int.*1\.0"):
        token_count("num_computed_tokens", 1.0)
    with pytest.raises(TypeError, match="True"):
        token_count("n", True)
    with pytest.raises(ValueError, match=r"n=9223372036854775808 does not fit in 64 bits"):
        token_count("n", 2**63)


@dataclass
class _Report:
    job_id: object
    success: object


def test_job_report_reads_tuples_and_objects_and_refuses_misreadable_ones() -> None:
    assert job_report((3, True)) == (3, True)
    assert job_report(_Report(np.int32(4), np.bool_(False))) == (4, False)
    with pytest.raises(ValueError, match="pair"):
        job_report((1, True, 2))
    with pytest.raises(TypeError, match=r"success='False'"):
        job_report((1, "False"))  # a truthy string must not count as a success
    with pytest.raises(TypeError, match=r"job_id=1\.0"):
        job_report((1.0, True))  # a float id is not truncated to another job
    with pytest.raises(TypeError, match="must be a JobReport"):
        job_report(object())


def test_check_count_names_the_argument_its_range_and_unit() -> None:
    check_count("num_blocks", 5, 1, 10, "[1, 10]", "CPU blocks")
    for bad in (0, 11, True, 2.0, None):
        with pytest.raises(ValueError, match=r"num_blocks=.* must be an int in \[1, 10\] \(CPU"):
            check_count("num_blocks", bad, 1, 10, "[1, 10]", "CPU blocks")


def test_key_bytes_encodes_ints_as_the_cores_8_little_endian_bytes() -> None:
    assert key_bytes(1) == b"\x01" + b"\x00" * 7
    assert key_bytes(-1) == b"\xff" * 8  # two's complement, as the C++ manager's int64 keys
    assert key_bytes(2**64 - 1) == b"\xff" * 8
    assert key_bytes(bytearray(b"ab")) == b"ab"
    with pytest.raises(ValueError, match=r"outside \[-2\*\*63, 2\*\*64\)"):
        key_bytes(2**64)
    for bad in (b"", True, "ab", None):
        with pytest.raises(TypeError, match="non-empty bytes or a 64-bit int"):
            key_bytes(bad)
