"""dataset_digest of a data set that is not a TensorDataset: every example, streamed."""

import numpy as np
import pytest
import torch

from dpmf.train.private_loader import TransformedDataset
from dpmf.train.state import dataset_digest

pytestmark = pytest.mark.torch


class Dicts(torch.utils.data.Dataset):
    def __init__(self, n=40, order=None, change=None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, generator=g)
        self.order = list(range(n)) if order is None else list(order)
        self.change = change

    def __len__(self):
        return len(self.order)

    def __getitem__(self, i):
        x = self.x[self.order[i]].clone()
        if self.change == i:
            x[0] = torch.nextafter(x[0], torch.tensor(10.0))  # one ulp
        return {"x": x, "label": int(self.order[i]) % 2, "name": f"ex{self.order[i]}", "a": np.ones(2)}


def test_equal_data_sets_have_equal_digests_and_a_transform_is_not_hashed():
    d = dataset_digest(Dicts())
    assert d is not None and d.startswith("all-") and d == dataset_digest(Dicts())
    noisy = TransformedDataset(Dicts(), lambda e: {**e, "x": e["x"] + torch.randn(3)})
    assert dataset_digest(noisy) == d  # the stored examples, not their random transform


def test_reordered_shorter_or_changed_data_sets_have_other_digests():
    d = dataset_digest(Dicts())
    assert dataset_digest(Dicts(order=range(39, -1, -1))) != d
    assert dataset_digest(Dicts(n=39)) != d
    assert dataset_digest(Dicts(change=13)) != d


@pytest.mark.parametrize("index", [1, 6, 38])
def test_one_changed_example_anywhere_changes_the_digest(index):
    # indices 1, 6 and 38 were outside the 16 examples the sampled digest of earlier versions read
    from dpmf.train.state import sampled_dataset_digest

    assert sampled_dataset_digest(Dicts(change=index)) == sampled_dataset_digest(Dicts())
    assert dataset_digest(Dicts(change=index)) != dataset_digest(Dicts())


def test_an_example_without_stable_bytes_is_not_compared():
    class Opaque(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return object()

    assert dataset_digest(Opaque()) is None
