"""Batches and model outputs as trees of tensors: containers kept, tensors mapped.

A model's output is often not one tensor: a tuple, a dict, or a Hugging Face ``ModelOutput``
(an ordered dict with attribute access) holding tensors and non-tensor entries such as a
key/value cache. ``map_tensors`` applies a function to every tensor and rebuilds each container
as its own type, so a loss written for the model's output (``outputs.logits``) receives that
type; ``batched_leaves`` splits a tree into the tensors whose dim 0 holds the examples (to be
``vmap``-ed) and a rebuild that puts everything else back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["batched_leaves", "map_tensors"]


def _rebuilt(tree, items: dict):
    """A mapping of ``tree``'s own type with ``items`` (ModelOutput takes keyword fields)."""
    if type(tree) is dict:
        return items
    try:
        return type(tree)(**items)
    except TypeError:  # keys that are not identifiers, or a mapping built from pairs
        return type(tree)(items)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree):
    """``tree`` with ``fn`` applied to each tensor: tuples, lists and mappings (a ``ModelOutput``
    included) rebuilt as their own types; any other leaf (None, a number, a cache object)
    unchanged."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return _rebuilt(tree, {k: map_tensors(fn, v) for k, v in tree.items()})
    if isinstance(tree, list | tuple):
        items = [map_tensors(fn, v) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree


def batched_leaves(tree, b: int) -> tuple[list[torch.Tensor], Callable[[list], object]]:
    """(the tensors of ``tree`` whose dim 0 has ``b`` entries, in order; ``rebuild(values)``:
    ``tree`` with those tensors replaced by ``values`` and every other entry unchanged).

    ``vmap`` over the returned tensors sees only per-example data: a cache object or a tensor
    shared by the batch passes through to the loss as it is."""
    leaves: list[torch.Tensor] = []
    spec = _spec(tree, b, leaves)
    return leaves, lambda values: _fill(spec, values)


def _spec(tree, b: int, leaves: list):
    """The layout of ``tree``: ("slot", k) for the k-th batched tensor, ("keep", value) for any
    other leaf, ("map", tree, [(key, spec)]) and ("seq", tree, [spec]) for containers."""
    if isinstance(tree, torch.Tensor):
        if tree.dim() >= 1 and tree.shape[0] == b:
            leaves.append(tree)
            return ("slot", len(leaves) - 1)
        return ("keep", tree)
    if isinstance(tree, dict):
        return ("map", tree, [(k, _spec(v, b, leaves)) for k, v in tree.items()])
    if isinstance(tree, list | tuple):
        return ("seq", tree, [_spec(v, b, leaves) for v in tree])
    return ("keep", tree)


def _fill(spec, values: list):
    kind, what = spec[0], spec[1]
    if kind == "slot":
        return values[what]
    if kind == "keep":
        return what
    if kind == "map":
        return _rebuilt(what, {k: _fill(v, values) for k, v in spec[2]})
    items = [_fill(v, values) for v in spec[2]]
    return type(what)(*items) if hasattr(what, "_fields") else type(what)(items)
