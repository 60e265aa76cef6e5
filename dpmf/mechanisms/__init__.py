"""Factorizations A = B·C: power-series algebra, strategies, sensitivity, errors, bounds."""

from dpmf.mechanisms.banded_opt import BandedResult, optimize_banded
from dpmf.mechanisms.blt import (
    BLTFactorization,
    BLTResult,
    BufferedToeplitz,
    blt_coefficients,
    blt_inverse_parameters,
    blt_noise,
    blt_prefix_error,
    blt_sensitivity,
    optimize_blt,
)
from dpmf.mechanisms.bounds import lower_bound, nuclear_norm
from dpmf.mechanisms.dense import DenseResult, optimize_dense, reverse_cholesky
from dpmf.mechanisms.errors import Evaluation, b_row_norms, evaluate, max_se, mean_se
from dpmf.mechanisms.factorizations import (
    BANDED,
    FACTORIZATIONS,
    OPTIMIZED,
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
    "BLTFactorization",
    "BLTResult",
    "BandedResult",
    "BufferedToeplitz",
    "DenseResult",
    "FACTORIZATIONS",
    "OPTIMIZED",
    "PARTICIPATIONS",
    "DenseLowerTriangular",
    "Evaluation",
    "Factorization",
    "Participation",
    "ScaledToeplitz",
    "Sensitivity",
    "b_row_norms",
    "band",
    "blt_coefficients",
    "blt_inverse_parameters",
    "blt_noise",
    "blt_prefix_error",
    "blt_sensitivity",
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
    "optimize_banded",
    "optimize_blt",
    "optimize_dense",
    "parse_factorization",
    "reverse_cholesky",
    "sensitivity",
    "sqrt_coefficients",
    "toeplitz_product",
]
