"""Eviction policies and admission rules, by name.

``create("arc", capacity=1000)`` builds a registered policy; ``"package.module:ClassName"``
loads an out-of-tree one (a subclass of :class:`EvictionPolicy`). Names are case-insensitive.
"""

from __future__ import annotations

import importlib
from typing import Any

from tiering.policies.admission import StoreThreshold
from tiering.policies.arc import ArcPolicy
from tiering.policies.base import EvictionPolicy, Key, evict_or_none
from tiering.policies.lru import LruPolicy
from tiering.policies.s3fifo import S3FifoPolicy

REGISTRY: dict[str, type[EvictionPolicy[Any]]] = {
    cls.name: cls for cls in (LruPolicy, ArcPolicy, S3FifoPolicy)
}

__all__ = ["REGISTRY", "ArcPolicy", "EvictionPolicy", "Key", "LruPolicy", "S3FifoPolicy",
           "StoreThreshold", "create", "evict_or_none", "resolve", "register"]


def register(cls: type[EvictionPolicy[Any]]) -> type[EvictionPolicy[Any]]:
    """Add a policy class to the registry under ``cls.name`` (usable as a decorator)."""
    REGISTRY[cls.name.lower()] = cls
    return cls


def resolve(name: str) -> type[EvictionPolicy[Any]]:
    """The policy class for a registered name or a ``module:Class`` path; ValueError if none."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy must be a non-empty string, got {name!r}")
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"policy {name!r}: cannot import module {module_name!r}: {exc}") from exc
        cls = getattr(module, class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
            raise ValueError(
                f"policy {name!r}: {module_name}.{class_name} is not an EvictionPolicy subclass")
        return cls
    cls = REGISTRY.get(name.lower())
    if cls is None:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"unknown policy {name!r}; known policies: {known} "
                         "(or 'package.module:ClassName' for your own)")
    return cls


def create(name: str, capacity: int, **kwargs: Any) -> EvictionPolicy[Any]:
    """Build a policy by name for a tier of ``capacity`` keys."""
    return resolve(name)(capacity, **kwargs)
