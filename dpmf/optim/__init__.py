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

import importlib

# Every name is imported from its module on first use (PEP 562): importing a torch-free module
# of this package (the optimizer registry) does not import torch.
_HOMES = {
    "BatchCheckError": "dpmf.optim.batches",
    "DrawnBatches": "dpmf.optim.batches",
    "bias_corrected": "dpmf.optim.bias_correction",
    "newton_schulz_bc": "dpmf.optim.bias_correction",
    "richardson_weights": "dpmf.optim.bias_correction",
    "NonFiniteGradientError": "dpmf.optim.clipping",
    "check_per_example_safe": "dpmf.optim.clipping",
    "clipped_sum": "dpmf.optim.clipping",
    "per_example_gradients": "dpmf.optim.clipping",
    "DiskLookahead": "dpmf.optim.disk",
    "FILTERS": "dpmf.optim.filters",
    "Disk": "dpmf.optim.filters",
    "Doppler": "dpmf.optim.filters",
    "disk_extrapolation_weight": "dpmf.optim.filters",
    "make_filter": "dpmf.optim.filters",
    "single_pass_gamma": "dpmf.optim.filters",
    "ClippingHandler": "dpmf.optim.clipping_layers",
    "clipping_layer": "dpmf.optim.clipping_layers",
    "register_clipping_layer": "dpmf.optim.clipping_layers",
    "registered_clipping_layers": "dpmf.optim.clipping_layers",
    "EvaluationPoint": "dpmf.optim.lookahead",
    "aspect_factor": "dpmf.optim.matrix",
    "check_matrix_parameter": "dpmf.optim.matrix",
    "matrix_shape": "dpmf.optim.matrix",
    "matrix_view": "dpmf.optim.matrix",
    "ModelChangedError": "dpmf.optim.model_guard",
    "ModelStateChangedError": "dpmf.optim.model_guard",
    "QUINTIC_COEFFICIENTS": "dpmf.optim.orthogonalization",
    "newton_schulz": "dpmf.optim.orthogonalization",
    "BandedSqrtNoise": "dpmf.optim.noise",
    "BLTNoise": "dpmf.optim.noise",
    "CorrelatedNoise": "dpmf.optim.noise",
    "DenseInverseNoise": "dpmf.optim.noise",
    "ToeplitzInverseNoise": "dpmf.optim.noise",
    "identity_noise": "dpmf.optim.noise",
    "noise_for_factorization": "dpmf.optim.noise",
    "DPSGD": "dpmf.optim.optimizers",
    "PLACEHOLDER_RULES": "dpmf.optim.optimizers",
    "DPAdam": "dpmf.optim.optimizers",
    "DPMuon": "dpmf.optim.optimizers",
    "DPMuonBC": "dpmf.optim.optimizers",
    "DPMuonS": "dpmf.optim.optimizers",
    "DPOptimizer": "dpmf.optim.optimizers",
    "build_transform": "dpmf.optim.optimizers",
    "dp_adam": "dpmf.optim.optimizers",
    "dp_muon": "dpmf.optim.optimizers",
    "dp_muon_bc": "dpmf.optim.optimizers",
    "dp_muon_s": "dpmf.optim.optimizers",
    "dp_sgd": "dpmf.optim.optimizers",
    "make_optimizer": "dpmf.optim.optimizers",
    "top_singular_value": "dpmf.optim.power_iteration",
    "PrivateStep": "dpmf.optim.privatize",
    "Privatizer": "dpmf.optim.privatize",
    "OPTIMIZERS": "dpmf.optim.registry",
    "OptimizerSpec": "dpmf.optim.registry",
    "get_optimizer": "dpmf.optim.registry",
    "optimizer_names": "dpmf.optim.registry",
    "register_optimizer": "dpmf.optim.registry",
    "route_parameters": "dpmf.optim.routing",
    "rule_of": "dpmf.optim.routing",
    "LearningRateSchedule": "dpmf.optim.schedules",
    "lr_scheduler": "dpmf.optim.schedules",
    "AddDecayedWeights": "dpmf.optim.transforms",
    "Chain": "dpmf.optim.transforms",
    "EmaMomentum": "dpmf.optim.transforms",
    "HeavyBall": "dpmf.optim.transforms",
    "Identity": "dpmf.optim.transforms",
    "Orthogonalize": "dpmf.optim.transforms",
    "OrthogonalizeBiasCorrected": "dpmf.optim.transforms",
    "Scale": "dpmf.optim.transforms",
    "ScaleByAdam": "dpmf.optim.transforms",
    "ScaleByShape": "dpmf.optim.transforms",
    "ScaleBySpectralNorm": "dpmf.optim.transforms",
    "StepContext": "dpmf.optim.transforms",
    "Transform": "dpmf.optim.transforms",
    "chain": "dpmf.optim.transforms",
}

__all__ = [
    # private gradient
    "NonFiniteGradientError",
    "check_per_example_safe",
    "clipped_sum",
    "register_clipping_layer",
    "clipping_layer",
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
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
