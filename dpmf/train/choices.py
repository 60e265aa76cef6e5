"""Names of the data sets and models of ``dpmf train``, importable without torch
(``dpmf.train.config`` validates a configuration against them); the loaders are in
``dpmf.train.data``, the models in ``dpmf.train.models``."""

__all__ = ["DATASETS", "MODELS"]

DATASETS = ("fashion-mnist", "cifar10", "digits")
MODELS = ("cnn", "cnn3", "mlp", "wrn16-4")
