"""The vLLM releases the integration is tested with, and what it does on the others
(kvoff/integrations/vllm/versions.py): one warning on an untested release, and a clear refusal
at start where vLLM's OffloadingConnector hands workers device pointers (vLLM 0.34.0), which
kvoff's spec worker cannot copy from."""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _submit_store_034(self: Any, job_id: int, device_ptrs: Any, dst_spec: Any) -> bool:
    """vLLM 0.34.0's ``OffloadingWorker.submit_store`` (``vllm/v1/kv_offload/base.py``)."""
    raise AssertionError("never called")


def test_the_installed_vllm_is_tested_and_has_the_worker_interface_of_the_spec() -> None:
    from kvoff.integrations.vllm import VLLM_TESTED_VERSIONS
    from kvoff.integrations.vllm.versions import check_offloading_worker_interface, vllm_version

    assert vllm_version() in VLLM_TESTED_VERSIONS
    check_offloading_worker_interface()  # vLLM 0.32: submit_store(job_id, src_spec, dst_spec)


def test_a_vllm_that_hands_workers_device_pointers_is_refused_before_the_spec_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, the spec started and every store failed in the worker (kvoff's worker reads
    GPU block ids from the spec vLLM 0.34 replaced by raw pointers)."""
    from vllm.v1.kv_offload.base import OffloadingWorker

    from kvoff.integrations.vllm import KvoffOffloadingSpec
    from kvoff.integrations.vllm.versions import check_offloading_worker_interface

    monkeypatch.setattr(OffloadingWorker, "submit_store", _submit_store_034)
    message = (
        r"this vLLM \S+ calls submit_store\(job_id, device_ptrs, dst_spec\)\. Use kvoff's own "
        r'connector instead \(kv_connector="KvoffConnector".*install vllm==0\.32\.0'
    )
    with pytest.raises(RuntimeError, match=message):
        check_offloading_worker_interface()
    with pytest.raises(RuntimeError, match=message):  # before any of vLLM's config is read
        KvoffOffloadingSpec(object())


def test_an_untested_vllm_is_warned_about_once_per_integration(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm

    from kvoff.integrations.vllm import versions

    monkeypatch.setattr(versions, "_warned", set())
    caplog.set_level(logging.WARNING, logger=versions.__name__)
    assert not versions.warn_if_untested("KvoffConnector")  # the tested 0.32.0
    assert not caplog.records
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    assert versions.warn_if_untested("KvoffConnector")
    assert not versions.warn_if_untested("KvoffConnector")  # once
    assert versions.warn_if_untested("KvoffOffloadingSpec")
    assert len(caplog.records) == 2
    text = caplog.records[0].getMessage()
    assert "KvoffConnector is tested with vLLM 0.32.0, and this is vLLM 0.34.0" in text
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setattr(vllm, "__version__", "0.32.0+cu130")  # a platform build of 0.32.0
    assert not versions.warn_if_untested("KvoffConnector")
