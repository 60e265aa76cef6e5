"""The matrix view of a weight tensor, as the spectral optimizers see it.

A linear weight of shape (out, in) is its own matrix; a convolution kernel of shape
(out, in, kh, kw) (or any tensor with two or more dimensions) is read as the matrix
out × (in·kh·kw), rows indexed by the output channel. This is the convention of DP-Muon
("Spectral Gradient Orthogonalization Improves Differentially Private Training at Scale",
Sec. Method, item 3).

Tensors with fewer than two dimensions have no matrix view. A tensor whose view has a single
row or a single column (a bias stored as (C, 1, 1), a (1, d) token) is a vector in disguise:
orthogonalizing it would only normalize it, so the matrix rules refuse it and ask for an
explicit vector rule instead.
"""

from __future__ import annotations

import math

import torch

from dpmf._validation import check_real

__all__ = ["matrix_shape", "matrix_view", "check_matrix_parameter", "aspect_factor"]


def matrix_shape(shape) -> tuple[int, int]:
    """Return (rows, cols) = (shape[0], prod(shape[1:])) of a tensor with ≥ 2 dimensions.

    Raises:
        ValueError: fewer than two dimensions.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"shape={shape} is invalid: a matrix view needs a tensor with at least 2 dimensions")
    return shape[0], math.prod(shape[1:])


def matrix_view(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` reshaped to rows × cols = shape[0] × prod(shape[1:]).

    A view (no copy) when the tensor is contiguous. A 2-D tensor is returned unchanged.

    Raises:
        TypeError: not a tensor.
        ValueError: fewer than two dimensions.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor={type(tensor).__name__} is invalid: must be a torch.Tensor")
    rows, cols = matrix_shape(tensor.shape)
    return tensor if tensor.ndim == 2 else tensor.reshape(rows, cols)


def check_matrix_parameter(name: str, shape) -> tuple[int, int]:
    """Check that a parameter of ``shape`` may use a matrix rule; return its (rows, cols).

    Raises:
        ValueError: fewer than two dimensions, or a view with a single row or column, with a
            message naming the parameter and the fix (route it to a vector rule).
    """
    shape = tuple(int(s) for s in shape)
    fix = (
        "route it to a vector rule ('sgd' or 'adam'), e.g. "
        f"route_parameters(model, rules={{{name!r}: 'sgd'}})"
    )
    if len(shape) < 2:
        raise ValueError(
            f"parameter {name!r} of shape {shape} cannot use a matrix rule (Newton–Schulz takes "
            f"matrices only): {fix}"
        )
    rows, cols = matrix_shape(shape)
    if rows == 1 or cols == 1:
        raise ValueError(
            f"parameter {name!r} of shape {shape} has the degenerate matrix view {rows}×{cols}: "
            f"orthogonalizing it would only normalize a vector; {fix}"
        )
    return rows, cols


def aspect_factor(rows: int, cols: int, cap: float | None = 4.0) -> float:
    """Return the aspect-ratio factor √min(cap, max(1, rows/cols)) (no cap when ``cap`` is None).

    DP-Muon uses cap = 4 (factor at most 2); DP-Muon-S uses no cap, √max(1, m/n)
    (the DP-Muon paper, Sec. Method, items 3 and 4).

    Raises:
        ValueError: rows or cols < 1, or cap < 1.
    """
    if rows < 1 or cols < 1:
        raise ValueError(f"rows={rows}, cols={cols} is invalid: both must be >= 1")
    ratio = max(1.0, rows / cols)
    if cap is not None:
        cap = check_real("cap", cap, low=1.0)
        ratio = min(cap, ratio)
    return math.sqrt(ratio)
