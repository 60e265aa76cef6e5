"""A module imported when one of its attributes is first read (below every layer, stdlib only).

dp-accounting and ``scipy.stats`` take about a second to import; a command that never accounts
in its own process (``dpmf fl --privacy record`` accounts in background processes) should not
pay it at start-up. ``lazy_module("dp_accounting")`` stands for the module: reading an attribute
imports it then (once; Python caches modules) and returns the module's attribute.
"""

from __future__ import annotations

import importlib

__all__ = ["lazy_module"]


class _LazyModule:
    __slots__ = ("_name",)

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy_module(name: str) -> _LazyModule:
    """A stand-in for module ``name`` that imports it at the first attribute read.

    Raises (at that read):
        ImportError: the module is not installed.
    """
    return _LazyModule(name)
