"""vLLM's own tests (0.33.0), adapted to run against our classes: the contracts we implement.

They are written against vLLM 0.33's interfaces, so they are collected only where vLLM 0.33
or later is installed (``make test`` runs them in the 0.33 environment); elsewhere this folder
is left out of collection rather than reported as skipped tests.
"""

from __future__ import annotations


def _vllm_version() -> tuple[int, ...]:
    try:
        import vllm
    except ImportError:
        return ()
    return tuple(int(x) for x in vllm.__version__.split(".")[:2] if x.isdigit())


collect_ignore_glob = [] if _vllm_version() >= (0, 33) else ["test_*.py"]
