"""Factorizations A = B·C: power-series algebra, strategies, sensitivity, errors, bounds."""

from dpmf.mechanisms.bounds import lower_bound, nuclear_norm
from dpmf.mechanisms.errors import Evaluation, b_row_norms, evaluate, max_se, mean_se
from dpmf.mechanisms.factorizations import (
    BANDED,
    FACTORIZATIONS,
    Factorization,
    factorize,
    parse_factorization,
)
from dpmf.mechanisms.participation import PARTICIPATIONS, Participation
from dpmf.mechanisms.sensitivity import Sensitivity, gram, sensitivity
from dpmf.mechanisms.structured import DenseLowerTriangular, ScaledToeplitz
from dpmf.mechanisms.toeplitz import (
    band,
    binomial_series,
    inverse_coefficients,
    inverse_sqrt_coefficients,
    sqrt_coefficients,
    toeplitz_product,
)

__all__ = [
    "BANDED",
    "FACTORIZATIONS",
    "PARTICIPATIONS",
    "DenseLowerTriangular",
    "Evaluation",
    "Factorization",
    "Participation",
    "ScaledToeplitz",
    "Sensitivity",
    "b_row_norms",
    "band",
    "binomial_series",
    "evaluate",
    "factorize",
    "gram",
    "inverse_coefficients",
    "inverse_sqrt_coefficients",
    "lower_bound",
    "max_se",
    "mean_se",
    "nuclear_norm",
    "parse_factorization",
    "sensitivity",
    "sqrt_coefficients",
    "toeplitz_product",
]
