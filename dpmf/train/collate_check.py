"""A check that a user's ``collate_fn`` treats the examples of a batch independently.

Per-example clipping bounds each example's contribution to the step by ζ only if each row of
the collated batch depends on its own example alone. A ``collate_fn`` that couples the rows —
centring on the batch mean, in-batch mixup, normalising by batch statistics — lets one example
move every row, so every clipped gradient: the sensitivity is no longer ζ (as with BatchNorm,
which ``check_per_example_safe`` refuses). ``check_collate_independent`` collates a few
examples together and each alone, and compares: row j of ``collate_fn([e_0, …, e_k])`` must
equal ``collate_fn([e_j])``. Padding collators (which pad each example to the batch's longest)
are compared on the example's own positions: when the two tensors differ in one dimension
only, the shorter must equal the longer's leading or trailing slice (right or left padding).
Leaves that are not tensors, and tensors whose shapes differ in more than one dimension, are
not compared.
"""

from __future__ import annotations

import torch

__all__ = ["check_collate_independent"]


def check_collate_independent(dataset, collate_fn, indices=None) -> None:
    """Refuse a ``collate_fn`` whose rows depend on the other examples of the batch.

    Args:
        dataset: a map-style data set (as the loader fetches it, transform applied).
        collate_fn: the user's collate function (list of examples → batch).
        indices: the examples to collate (default: the first, the middle and the last).

    Raises:
        ValueError: one line: a row of the collated batch differs from the example collated
            alone, naming the fix (couple per example, in ``transform``, or no ``collate_fn``).
    """
    n = len(dataset)
    if indices is None:
        indices = sorted({0, n // 2, n - 1})
    if len(indices) < 2:
        return  # one example couples with nothing
    examples = [dataset[i] for i in indices]
    together = collate_fn(examples)
    for j, e in enumerate(examples):
        alone = collate_fn([e])
        if not _rows_match(together, alone, j):
            raise ValueError(
                f"collate_fn={getattr(collate_fn, '__name__', type(collate_fn).__name__)} is invalid: "
                "the row of an example in a collated batch differs from the example collated alone, so "
                "it depends on the batch's other examples (e.g. centring or normalising on batch "
                "statistics, in-batch mixup), and one example would move every clipped gradient "
                "(per-example privacy needs each example treated independently); do the operation per "
                "example (transform=, with fixed statistics) or pass no collate_fn"
            )


def _rows_match(together, alone, j: int) -> bool:
    """Row ``j`` of ``together`` against the one-example batch ``alone`` (True when not comparable)."""
    if isinstance(together, torch.Tensor) and isinstance(alone, torch.Tensor):
        return _tensor_row_matches(together, alone, j)
    if isinstance(together, dict) and isinstance(alone, dict):
        if set(together) != set(alone):
            return True
        return all(_rows_match(together[k], alone[k], j) for k in together)
    if isinstance(together, list | tuple) and isinstance(alone, list | tuple):
        if len(together) != len(alone):
            return True
        return all(_rows_match(a, b, j) for a, b in zip(together, alone, strict=True))
    return True


def _tensor_row_matches(together: torch.Tensor, alone: torch.Tensor, j: int) -> bool:
    if together.dim() == 0 or alone.dim() != together.dim() or alone.shape[0] != 1:
        return True
    if j >= together.shape[0]:
        return True
    row, one = together[j], alone[0]
    if row.shape != one.shape:  # padding: compare the example's own positions
        differ = [d for d in range(row.dim()) if row.shape[d] != one.shape[d]]
        if len(differ) != 1 or one.shape[differ[0]] > row.shape[differ[0]]:
            return True
        d, size = differ[0], one.shape[differ[0]]
        return _equal(row.narrow(d, 0, size), one) or _equal(row.narrow(d, row.shape[d] - size, size), one)
    return _equal(row, one)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_complex or b.dtype.is_complex:
        return bool(torch.allclose(a.detach().cpu(), b.detach().cpu(), rtol=1e-5, atol=1e-7))
    if a.dtype.is_floating_point or b.dtype.is_floating_point:
        a64, b64 = a.detach().cpu().double(), b.detach().cpu().double()
        scale = float(b64.abs().max()) if b64.numel() else 0.0
        return bool(torch.allclose(a64, b64, rtol=1e-5, atol=1e-7 * max(scale, 1.0), equal_nan=True))
    return bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
