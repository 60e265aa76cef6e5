"""Torch side of dpmf: the private gradient (per-example clipping, streaming correlated noise),
DP optimizers and their update stages.

Private gradient: ``clipped_sum`` (per-example gradients by ``torch.func``, global ℓ2 clipping,
sum), the noise streams of ``dpmf.optim.noise`` (``noise_for_factorization``) and ``Privatizer``
(clip → sum → add σ·ζ·sens·(C⁻¹Z)_t → divide by the expected batch size), with its checks:
the batch drawn for the step, once (``DrawnBatches``), the model unchanged and unwritten
(``dpmf.optim.model_guard``).

Optimizers (post-processing of the privatized gradient): ``DPSGD``, ``DPAdam``, ``DPMuon``,
``DPMuonS``, ``DPMuonBC``; parameter routing ``route_parameters``; learning-rate schedules
``lr_scheduler``; the stages they are composed of (``dpmf.optim.transforms``); the temporal
filters DOPPLER and DiSK for their ``filter`` hook (``dpmf.optim.filters``) with DiSK's
evaluation plan for the training loop (``dpmf.optim.lookahead``); Newton–Schulz
orthogonalization and its bias correction.
"""

# The private gradient.
# Optimizers and their building blocks.
from dpmf.optim.batches import BatchCheckError, DrawnBatches
from dpmf.optim.bias_correction import bias_corrected, newton_schulz_bc, richardson_weights
from dpmf.optim.clipping import (
    NonFiniteGradientError,
    check_per_example_safe,
    clipped_sum,
    per_example_gradients,
)
from dpmf.optim.disk import DiskLookahead
from dpmf.optim.filters import (
    FILTERS,
    Disk,
    Doppler,
    disk_extrapolation_weight,
    make_filter,
    single_pass_gamma,
)
from dpmf.optim.ghost_layers import ClippingHandler, register_clipping_layer, registered_clipping_layers
from dpmf.optim.lookahead import EvaluationPoint
from dpmf.optim.matrix import aspect_factor, check_matrix_parameter, matrix_shape, matrix_view
from dpmf.optim.model_guard import ModelChangedError, ModelStateChangedError
from dpmf.optim.newton_schulz import QUINTIC_COEFFICIENTS, newton_schulz
from dpmf.optim.noise import (
    BandedSqrtNoise,
    BLTNoise,
    CorrelatedNoise,
    DenseInverseNoise,
    ToeplitzInverseNoise,
    identity_noise,
    noise_for_factorization,
)
from dpmf.optim.optimizers import (
    DPSGD,
    PLACEHOLDER_RULES,
    DPAdam,
    DPMuon,
    DPMuonBC,
    DPMuonS,
    DPOptimizer,
    build_transform,
    dp_adam,
    dp_muon,
    dp_muon_bc,
    dp_muon_s,
    dp_sgd,
    make_optimizer,
)
from dpmf.optim.power_iteration import top_singular_value
from dpmf.optim.privatize import PrivateStep, Privatizer
from dpmf.optim.registry import (
    OPTIMIZERS,
    OptimizerSpec,
    get_optimizer,
    optimizer_names,
    register_optimizer,
)
from dpmf.optim.routing import route_parameters, rule_of
from dpmf.optim.schedules import LearningRateSchedule, lr_scheduler
from dpmf.optim.transforms import (
    AddDecayedWeights,
    Chain,
    EmaMomentum,
    HeavyBall,
    Identity,
    Orthogonalize,
    OrthogonalizeBiasCorrected,
    Scale,
    ScaleByAdam,
    ScaleByShape,
    ScaleBySpectralNorm,
    StepContext,
    Transform,
    chain,
)

__all__ = [
    # private gradient
    "NonFiniteGradientError",
    "check_per_example_safe",
    "clipped_sum",
    "register_clipping_layer",
    "registered_clipping_layers",
    "ClippingHandler",
    "per_example_gradients",
    "CorrelatedNoise",
    "ToeplitzInverseNoise",
    "BandedSqrtNoise",
    "BLTNoise",
    "DenseInverseNoise",
    "identity_noise",
    "noise_for_factorization",
    "Privatizer",
    "PrivateStep",
    "DrawnBatches",
    "BatchCheckError",
    "ModelChangedError",
    "ModelStateChangedError",
    # optimizers
    "DPOptimizer",
    "DPSGD",
    "DPAdam",
    "DPMuon",
    "DPMuonS",
    "DPMuonBC",
    "RULES",
    "MATRIX_RULES",
    "PLACEHOLDER_RULES",
    "build_transform",
    "make_optimizer",
    "OPTIMIZERS",
    "OptimizerSpec",
    "get_optimizer",
    "optimizer_names",
    "register_optimizer",
    "dp_sgd",
    "dp_adam",
    "dp_muon",
    "dp_muon_s",
    "dp_muon_bc",
    "route_parameters",
    "rule_of",
    "LearningRateSchedule",
    "lr_scheduler",
    # stages
    "Transform",
    "StepContext",
    "Chain",
    "chain",
    "Identity",
    "Scale",
    "AddDecayedWeights",
    "HeavyBall",
    "EmaMomentum",
    "ScaleByAdam",
    "Orthogonalize",
    "OrthogonalizeBiasCorrected",
    "ScaleBySpectralNorm",
    "ScaleByShape",
    # temporal filters
    "FILTERS",
    "Doppler",
    "Disk",
    "DiskLookahead",
    "EvaluationPoint",
    "make_filter",
    "single_pass_gamma",
    "disk_extrapolation_weight",
    # matrix maps
    "QUINTIC_COEFFICIENTS",
    "newton_schulz",
    "newton_schulz_bc",
    "bias_corrected",
    "richardson_weights",
    "top_singular_value",
    "matrix_view",
    "matrix_shape",
    "check_matrix_parameter",
    "aspect_factor",
]


def __getattr__(name):
    # RULES and MATRIX_RULES follow the optimizer registry
    if name in ("RULES", "MATRIX_RULES"):
        from dpmf.optim import optimizers

        return getattr(optimizers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
