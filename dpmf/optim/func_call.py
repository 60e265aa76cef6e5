"""``torch.func.functional_call`` that leaves the module's own tensors in place.

In torch 2.13, ``functional_call`` on a model in which one submodule is reachable by two paths
(``nn.Sequential(layer, act, layer)``) does not put that submodule's parameters back: after the
call the submodule holds a plain tensor (the value it was called with) instead of its
``nn.Parameter``, so the model no longer trains the optimizer's parameters. This wrapper
records every submodule's ``_parameters`` and ``_buffers`` entries first and puts back any the
call left replaced.
"""

from __future__ import annotations

from torch import nn
from torch.func import functional_call as _functional_call

__all__ = ["functional_call"]


def functional_call(module: nn.Module, values, args=(), kwargs=None):
    """``torch.func.functional_call(module, values, args, kwargs)``, the module's own
    parameters and buffers (identities) the same afterwards."""
    saved = [
        (m, dict(m._parameters), dict(m._buffers)) for m in module.modules()
    ]  # each submodule once (named_modules removes duplicates)
    try:
        return _functional_call(module, values, args, kwargs)
    finally:
        for m, params, buffers in saved:
            for own, kept in ((m._parameters, params), (m._buffers, buffers)):
                for k, t in kept.items():
                    if own.get(k) is not t:
                        own[k] = t
