# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Contract: vLLM's factories load our classes by module path, and TieredOffloadingSpec keeps
the sizing contract of vLLM's own specs.

Origin: vLLM 0.33.0 source distribution, licence Apache-2.0 (the vLLM project's
contributors): tests/v1/kv_offload/conftest.py (make_offloading_config),
tests/v1/kv_offload/test_factory.py (spec factory and spec sizing tests),
tests/v1/kv_offload/cpu/policies/test_factory.py (cache-policy factory tests) and
tests/v1/kv_offload/tiering/test_factory.py (secondary-tier factory tests). Each test names
the original it comes from; changes are marked ADAPTED.

NOT BROUGHT IN from test_factory.py: the tests of vLLM's own CPUOffloadingSpec and its
CPUOffloadingInfo/config_info labels, SharedOffloadRegion worker wiring (monkeypatched
platform checks), its registry's built-in entries and its CPU metric definitions: they test
vLLM's classes, not the contract ours implement. From policies/test_factory.py: the registry
tests of vLLM's built-in policies and of a dummy registered by name. From
tiering/test_factory.py: the registry sentinel of vLLM's built-in tiers and the factory's own
error paths (no tier of ours involved).
"""

from typing import Any

import pytest
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

import tiering.backends.staging as staging
import tiering.vllm as ours
from tiering.vllm import TieredOffloadingSpec

PAGE = 4096  # the row alignment of vLLM's CPU tier and of ours


@pytest.fixture(autouse=True)
def shm_in_tmp(tmp_path, monkeypatch):
    """ADAPTED: our staging region's folder moved under the test's tmp_path."""
    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")


# from tests/v1/kv_offload/conftest.py
def make_offloading_config(
    *,
    spec_name: str | None = "CPUOffloadingSpec",
    cpu_bytes_to_use: int | None = 65536,
    engine_id: str = "test-engine",
    worker_kv_bytes_per_block: int = 8,
    groups: tuple[OffloadingGroupConfig, ...] | None = None,
    tokens_per_hash: int = 16,
    blocks_per_chunk: int = 1,
    max_model_len: int = 4096,
    rank: int = 0,
    world_size: int = 1,
    tp_size: int | None = None,
    pp_size: int = 1,
    pcp_size: int = 1,
    dcp_size: int = 1,
    data_parallel_index: int = 0,
    data_parallel_size: int = 1,
    data_parallel_rank_local: int | None = None,
    is_parallelism_agnostic: bool = False,
    replicated_layout: bool = False,
    extra_config: dict[str, Any] | None = None,
) -> OffloadingConfig:
    normalized_extra_config = dict(extra_config or {})
    if spec_name is not None:
        normalized_extra_config["spec_name"] = spec_name
    if cpu_bytes_to_use is not None:
        normalized_extra_config["cpu_bytes_to_use"] = cpu_bytes_to_use

    if groups is None:
        groups = (OffloadingGroupConfig(16, ("layer",), 0),)

    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=normalized_extra_config,
        engine_id=engine_id,
        model=OffloadingModelConfig(
            name="test-model", dtype="float16", max_model_len=max_model_len
        ),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_hash,
            blocks_per_chunk=blocks_per_chunk,
        ),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size if tp_size is None else tp_size,
            pp_size=pp_size,
            pcp_size=pcp_size,
            dcp_size=dcp_size,
            data_parallel_index=data_parallel_index,
            data_parallel_size=data_parallel_size,
            data_parallel_rank_local=data_parallel_rank_local,
            is_parallelism_agnostic=is_parallelism_agnostic,
        ),
        replicated_layout=replicated_layout,
    )


def _create_our_spec(**kwargs: Any) -> TieredOffloadingSpec:
    """ADAPTED: vLLM's _create_spec, selecting our spec by name and module path."""
    extra = {"spec_module_path": "tiering.vllm", **kwargs.pop("extra_config", {})}
    spec = OffloadingSpecFactory.create_spec(make_offloading_config(
        spec_name="TieredOffloadingSpec", extra_config=extra, **kwargs))
    assert isinstance(spec, TieredOffloadingSpec)
    return spec


# -- from tests/v1/kv_offload/test_factory.py ---------------------------------------------------


def test_create_dynamic_spec_receives_config():
    # ADAPTED: our spec instead of the test module's SingleArgExternalOffloadingSpec
    config = make_offloading_config(
        spec_name="TieredOffloadingSpec",
        extra_config={"spec_module_path": "tiering.vllm"},
    )

    spec = OffloadingSpecFactory.create_spec(config)

    assert isinstance(spec, TieredOffloadingSpec)
    assert spec.config is config


def test_offloading_spec_has_replicated_layout_default():
    spec = _create_our_spec()
    assert spec.replicated_layout is False


def test_tiering_spec_aligns_row_size():
    # ADAPTED: our names for the same sizes: cell_bytes (vLLM: cpu_page_size_per_worker),
    # row_bytes (kv_bytes_per_chunk), num_rows (num_chunks)
    spec = _create_our_spec(
        cpu_bytes_to_use=PAGE * 3,
        worker_kv_bytes_per_block=16,
        blocks_per_chunk=2,
        world_size=6,
        tp_size=3,
        pp_size=2,
    )

    assert spec.cell_bytes == 32
    assert spec.row_bytes == PAGE
    assert spec.num_rows == 3


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_tiering_spec_replicated_sizing_removes_world_factor(world_size: int):
    # ADAPTED: names as above
    worker_kv_bytes_per_block = PAGE
    spec = _create_our_spec(
        cpu_bytes_to_use=worker_kv_bytes_per_block * 8,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        world_size=world_size,
        replicated_layout=True,
    )

    assert spec.replicated_layout is True
    assert spec.cell_bytes == worker_kv_bytes_per_block
    assert spec.row_bytes == worker_kv_bytes_per_block
    assert spec.num_rows == 8


def test_offloading_spec_uses_normalized_chunk_geometry():
    groups = (
        OffloadingGroupConfig(12, ("full_layer",), 0),
        OffloadingGroupConfig(16, ("mla_layer",), 1),
    )
    spec = _create_our_spec(
        groups=groups,
        tokens_per_hash=4,
        blocks_per_chunk=2,
    )

    assert spec.tokens_per_block == (12, 16)
    assert spec.tokens_per_hash == 4
    assert spec.blocks_per_chunk == 2


def test_cpu_spec_missing_cpu_bytes_to_use_raises():
    # ADAPTED: ours raises ValueError naming the key (vLLM: "cpu_bytes_to_use must be
    # specified")
    with pytest.raises(ValueError, match="cpu_bytes_to_use: required"):
        _create_our_spec(cpu_bytes_to_use=None)


# -- from tests/v1/kv_offload/cpu/policies/test_factory.py --------------------------------------

OUR_POLICY_CLASSES = ["S3FIFOPolicy", "TieringARCPolicy", "TieringLRUPolicy"]


@pytest.fixture
def restore_cache_policy_registry():
    """Save and restore CachePolicyFactory._registry between tests."""
    original = dict(CachePolicyFactory._registry)
    yield
    CachePolicyFactory._registry = original


@pytest.mark.parametrize("name", OUR_POLICY_CLASSES)
def test_dynamic_load_via_cache_policy_module_path(name, restore_cache_policy_registry):
    """Out-of-tree policy loaded via cache_policy_module_path, no
    register_cache_policy() call."""
    # ADAPTED: our classes instead of the test module's _DummyCachePolicy
    policy_cls = CachePolicyFactory.get_cache_policy_cls(name, "tiering.vllm")
    assert policy_cls is getattr(ours, name)


@pytest.mark.parametrize("name", OUR_POLICY_CLASSES)
def test_manager_resolves_policy_via_module_path(name, restore_cache_policy_registry):
    """End-to-end: CPUOffloadingManager resolves an unregistered policy
    purely from cache_policy_module_path."""
    manager = CPUOffloadingManager(
        num_chunks=4,
        cache_policy=name,
        cache_policy_module_path="tiering.vllm",
    )
    assert isinstance(manager._policy, getattr(ours, name))


@pytest.mark.parametrize("name", OUR_POLICY_CLASSES)
def test_register_and_resolve_custom_policy(name, restore_cache_policy_registry):
    # ADAPTED: our class registered under a name, then used by the manager by that name
    CachePolicyFactory.register_cache_policy("ours", "tiering.vllm", name)
    assert CachePolicyFactory.get_cache_policy_cls("ours") is getattr(ours, name)

    manager = CPUOffloadingManager(num_chunks=4, cache_policy="ours")
    assert isinstance(manager._policy, getattr(ours, name))


# -- from tests/v1/kv_offload/tiering/test_factory.py -------------------------------------------


@pytest.fixture
def restore_tier_registry():
    """Save and restore SecondaryTierFactory._registry between tests."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    original = dict(SecondaryTierFactory._registry)
    yield
    SecondaryTierFactory._registry = original


def _tier_args(tmp_path):
    """ADAPTED: vLLM passes MagicMocks (its example tier ignores both); ours opens its files,
    so it gets a page-aligned primary view and a spec with a config."""
    from unittest.mock import MagicMock

    import numpy as np

    buf = np.zeros(4 * PAGE + PAGE, dtype=np.uint8)
    shift = (-buf.ctypes.data) % PAGE
    view = memoryview(buf[shift:shift + 4 * PAGE].reshape(4, PAGE))
    spec = MagicMock()
    spec.config = make_offloading_config(worker_kv_bytes_per_block=PAGE)
    spec.kv_events_config.enable_kv_cache_events = False
    return view, spec


def _our_tier_config(tmp_path, name: str) -> dict:
    return {"path": str(tmp_path / name), "capacity": 8 * PAGE, "io": "posix"}


def test_create_tier_from_module_path(tmp_path, restore_tier_registry):
    """Full end-to-end: create_secondary_tier with module_path."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    primary_kv_view, offloading_spec = _tier_args(tmp_path)
    tier_config = {
        "type": "FileTier",
        "module_path": "tiering.vllm",
        **_our_tier_config(tmp_path, "kv"),
    }

    tier = SecondaryTierFactory.create_secondary_tier(
        tier_config, primary_kv_view, offloading_spec
    )
    try:
        assert isinstance(tier, ours.FileTier)
        assert tier.tier_type == "FileTier"
    finally:
        tier.shutdown()


def test_create_multiple_tiers(tmp_path, restore_tier_registry):
    """Multiple tier configs can be created with correct tier_types."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    primary_kv_view, offloading_spec = _tier_args(tmp_path)
    configs = [  # ADAPTED: two of ours, each with its own folder
        {"type": "FileTier", "module_path": "tiering.vllm", **_our_tier_config(tmp_path, "a")},
        {"type": "FileTier", "module_path": "tiering.vllm", **_our_tier_config(tmp_path, "b")},
    ]

    tiers = [
        SecondaryTierFactory.create_secondary_tier(
            cfg.copy(), primary_kv_view, offloading_spec
        )
        for cfg in configs
    ]
    try:
        assert len(tiers) == 2
        assert all(tier.tier_type == "FileTier" for tier in tiers)
        assert all(isinstance(tier, ours.FileTier) for tier in tiers)
    finally:
        for tier in tiers:
            tier.shutdown()


@pytest.mark.parametrize("tier_type", ["custom_tier", "cpu", "nvme"])
def test_register_new_tier_type(tmp_path, restore_tier_registry, tier_type):
    """New tier types can be registered and created (how external projects add tiers)."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    # ADAPTED: our tier registered under the name instead of vLLM's example tier
    SecondaryTierFactory.register_tier(tier_type, "tiering.vllm", "FileTier")

    primary_kv_view, offloading_spec = _tier_args(tmp_path)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": tier_type, **_our_tier_config(tmp_path, "kv")},
        primary_kv_view,
        offloading_spec,
    )
    try:
        assert tier.tier_type == tier_type
        assert isinstance(tier, ours.FileTier)
        # Attribution follows the tier's medium, never its registration name.
        # ADAPTED: ours is STORAGE, so DISK (vLLM's example tier is CPU, so HOST)
        assert tier.cache_hit_source is CacheHitSource.DISK
    finally:
        tier.shutdown()
