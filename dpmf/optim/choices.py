"""Names of the torch side's choices, importable without torch (``dpmf.train.config`` validates
a configuration against them before anything is loaded)."""

__all__ = ["CLIPPING_MODES"]

#: How per-example gradients are clipped and summed (``dpmf.optim.clipping.clipped_sum``).
CLIPPING_MODES = ("auto", "vmap", "ghost", "bk")
