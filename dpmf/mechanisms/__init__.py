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
from dpmf.mechanisms.factorizations import Factorization
from dpmf.mechanisms.lcgd import LCGDFactorization, LCGDResult, lcgd, optimize_lcgd
from dpmf.mechanisms.participation import PARTICIPATIONS, Participation
from dpmf.mechanisms.registry import (
    STRATEGIES,
    Strategy,
    factorize,
    get_strategy,
    parse_factorization,
    register_strategy,
    strategy_names,
)
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

#: the registered strategy names, those whose parameter is a band count, and the optimized ones
#: (snapshots of ``STRATEGIES`` at import; ``strategy_names()`` sees later registrations)
FACTORIZATIONS = strategy_names()
BANDED = tuple(
    name for name, e in STRATEGIES.items() if e.parameter is not None and e.parameter.name == "bands"
)
OPTIMIZED = tuple(name for name, e in STRATEGIES.items() if e.optimized)

__all__ = [
    "LCGDFactorization",
    "LCGDResult",
    "STRATEGIES",
    "Strategy",
    "get_strategy",
    "lcgd",
    "optimize_lcgd",
    "register_strategy",
    "strategy_names",
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
