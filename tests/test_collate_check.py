"""check_collate_independent: a collate_fn must treat a batch's examples independently."""

import pytest
import torch
from torch.utils.data._utils.collate import default_collate

import dpmf
from dpmf.train.collate_check import check_collate_independent

pytestmark = pytest.mark.torch


class Ragged(torch.utils.data.Dataset):
    """Token sequences of lengths 3, 5, 2, 6, … (dicts, as Hugging Face data)."""

    def __init__(self, n=9):
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(1, 50, (2 + (i * 3) % 5,), generator=g) for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ids = self.items[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def padded(side):
    def collate(batch):
        width = max(len(e["input_ids"]) for e in batch)
        out = {}
        for k in ("input_ids", "attention_mask"):
            rows = []
            for e in batch:
                pad = torch.zeros(width - len(e[k]), dtype=e[k].dtype)
                rows.append(torch.cat([e[k], pad] if side == "right" else [pad, e[k]]))
            out[k] = torch.stack(rows)
        return out

    return collate


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padding_collate_fn_is_accepted(side):
    data = Ragged()
    assert len({len(data[i]["input_ids"]) for i in (0, 4, 8)}) == 3  # the rows really are padded
    check_collate_independent(data, padded(side))


def test_a_per_example_collate_fn_is_accepted():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(10, 4, generator=g), torch.arange(10))

    def scaled(batch):  # a fixed per-example operation
        x, y = default_collate(batch)
        return 3.0 * x + 1.0, y

    check_collate_independent(data, scaled)


@pytest.mark.parametrize("coupling", ["centre", "mixup", "pad_to_batch_then_normalise"])
def test_a_coupling_collate_fn_is_refused_in_one_line(coupling):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(10, 4, generator=g), torch.arange(10))

    def couple(batch):
        x, y = default_collate(batch)
        if coupling == "centre":
            return x - x.mean(0, keepdim=True), y
        if coupling == "mixup":
            return 0.9 * x + 0.1 * x.flip(0), y
        return x / x.norm(), y  # one norm over the whole batch

    with pytest.raises(ValueError, match="collate_fn=couple is invalid") as err:
        check_collate_independent(data, couple)
    assert "\n" not in str(err.value) and "transform" in str(err.value)


# -- make_private: a collate_fn that couples the examples of a batch -----------------------------------
# make_private refuses BatchNorm because it couples examples, and equally a collate_fn that does the
# same to the inputs (here: centring each batch on its mean; in-batch mixup is another). Every
# example's input would then depend on every other example of the batch, so one example moves all B
# clipped gradients: the sensitivity is no longer ζ. backward alone cannot see it (its fingerprints
# are those of the coupled batch the loader yielded); a check such as collate_fn([dataset[i]])
# against row i of the batch does.
def test_a_collate_fn_that_couples_the_examples_is_refused():
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data._utils.collate import default_collate

    def centred(batch):
        x, y = default_collate(batch)
        return x - x.mean(0, keepdim=True), y

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    )
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with pytest.raises((ValueError, RuntimeError), match="collate"):
        private = dpmf.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy, batch_size=8,
            steps=2, noise_multiplier=1.0, factorization="identity", scheme="poisson", seed=1,
            collate_fn=centred,
        )  # fmt: skip
        x, y = next(iter(private.data_loader))
        private.backward(x, target=y, return_loss=False)
