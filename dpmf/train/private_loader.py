"""``make_private``'s data loader: a ``torch.utils.data.DataLoader`` whose batches are the plan's
sampler's, each recorded (per-example fingerprints, in the main process) as it is yielded, so
that the private step can check it receives exactly that batch (``dpmf.optim.batches``).

Per-example transformations (augmentation, conversion, normalization, extra per-example
inputs) go into ``transform``: it is applied to every example as it is fetched (in the worker
processes when ``num_workers ≥ 1``), before collation and before the fingerprint, so the
transformed batch is the one the step accepts. In the loop, a batch may only be moved to
another device or dtype.
"""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset

from dpmf.optim.batches import DrawnBatches

__all__ = ["PrivateDataLoader", "TransformedDataset", "check_dataset_size"]


class TransformedDataset(Dataset):
    """``dataset`` with ``transform`` applied to each example (``transform(dataset[i])``).

    Args:
        dataset: a map-style data set.
        transform: a callable on one example (as the data set returns it).
    """

    def __init__(self, dataset, transform):
        if not callable(transform):
            raise TypeError(f"transform={transform!r} is invalid: must be callable(example) -> example")
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.transform(self.dataset[i])


class _Epochs:
    """The ``batch_sampler`` of the loader: one epoch of draws per iteration, from ``drawn``."""

    def __init__(self, drawn: DrawnBatches):
        self.drawn = drawn

    @property
    def sampler(self):
        """The plan's sampler (global batches)."""
        s = self.drawn.sampler
        return getattr(s, "sampler", s)

    def __len__(self) -> int:
        return len(self.drawn.sampler)

    def __iter__(self):
        # called when a DataLoader iterator is built, right after PrivateDataLoader.__iter__'s
        # begin(): the token ties the draws to that iteration
        return self.drawn.epoch(self.drawn.generation)


def check_dataset_size(dataset, expected: int) -> None:
    """Refuse a data set whose length is no longer the plan's N (``len()``, no example fetched).

    Raises:
        ValueError: ``len(dataset) != expected``, naming both and the fix.
    """
    size = len(dataset)
    if size != expected:
        raise ValueError(
            f"dataset is invalid: it had {expected} examples when the run was made and has {size} now; "
            "the plan's sampler, σ and ε are for those N examples: keep the data set fixed for the whole "
            "run (call make_private again for other data)"
        )


class _Iterator:
    def __init__(self, base, drawn: DrawnBatches, token: int, dataset, size: int):
        self.base, self.drawn, self.token = base, drawn, token
        self.dataset, self.size = dataset, size

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self.base)

    def __next__(self):
        check_dataset_size(self.dataset, self.size)  # before any example of the batch is fetched
        batch = next(self.base)
        self.drawn.record_next(batch, self.token)
        return batch


class PrivateDataLoader(DataLoader):
    """A ``DataLoader`` over ``dataset`` whose batches are ``drawn``'s (the plan's sampler's),
    each fingerprinted as it is yielded.

    ``len()`` is the steps per epoch; each iteration continues the run's steps to the end of the
    current epoch. Starting a new iteration abandons the draws the previous one prefetched and
    did not yield (they are drawn again), and makes the previous iterator refuse its next batch.

    Args:
        dataset: a map-style data set.
        drawn: the private step's ``DrawnBatches`` (``Privatizer.draw_from``).
        collate_fn: the collate function.
        num_workers: worker processes (draws and fingerprints stay in the main process).
    """

    def __init__(self, dataset, drawn: DrawnBatches, *, collate_fn=None, num_workers: int = 0):
        super().__init__(
            dataset, batch_sampler=_Epochs(drawn), collate_fn=collate_fn, num_workers=num_workers
        )
        self.__dict__["_drawn"] = drawn
        self.__dict__["_size"] = len(dataset)

    def __iter__(self):
        check_dataset_size(self.dataset, self._size)
        token = self._drawn.begin()
        return _Iterator(super().__iter__(), self._drawn, token, self.dataset, self._size)
