"""Names of the torch side's choices, importable without torch (``dpmf.train.config`` validates
a configuration against them before anything is loaded)."""

__all__ = ["CLIPPING_MODES", "NOISE_GENERATORS"]

#: How per-example gradients are clipped and summed (``dpmf.optim.clipping.clipped_sum``).
CLIPPING_MODES = ("auto", "vmap", "ghost", "bk")

#: The raw-noise generators a run may name (``dpmf.optim.raw_noise``): ``device`` (the default:
#: the generator of the parameters' device), or one by name.
NOISE_GENERATORS = ("device", "torch-mt19937", "torch-philox-cuda", "numpy-philox")
