"""Private training: samplers, data, models, configuration, the loop and its checkpoints."""

from dpmf.train.config import TrainConfig
from dpmf.train.data import DATASETS, Dataset, load_dataset
from dpmf.train.loop import Trainer, TrainOutcome, evaluate
from dpmf.train.models import MODELS, build_model
from dpmf.train.run import TrainResult, train
from dpmf.train.samplers import SCHEMES, steps_per_epoch

__all__ = [
    "DATASETS",
    "MODELS",
    "SCHEMES",
    "Dataset",
    "TrainConfig",
    "TrainOutcome",
    "TrainResult",
    "Trainer",
    "build_model",
    "evaluate",
    "load_dataset",
    "steps_per_epoch",
    "train",
]
