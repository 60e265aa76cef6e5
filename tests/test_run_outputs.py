"""What leaves a make_private run is private or refused: state written between steps, exports
and checkpoints over another run's files, a data set that changed size, a DataLoader given as
the data set."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import dpmf
from dpmf.optim.model_guard import ModelStateChangedError

pytestmark = pytest.mark.torch

N, B, D = 64, 16, 6


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, 3, (N,), generator=g))


class Seen(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 3))
        self.register_buffer("seen_mean", torch.zeros(D))

    def forward(self, x):
        return self.net(x)


def _private(dataset=None, model=None, noise_multiplier=1.0):
    torch.manual_seed(0)
    model = Seen() if model is None else model
    return dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _data() if dataset is None else dataset,
        loss_fn=F.cross_entropy,
        batch_size=B,
        epochs=1,
        noise_multiplier=noise_multiplier,
        target_delta=1e-5,
        factorization="identity",
        scheme="poisson",
    )


def _step(private):
    x, y = next(iter(private.data_loader))
    private.backward(x, target=y, return_loss=False)
    private.optimizer.step()
    private.optimizer.zero_grad()
    return x


def test_a_buffer_set_from_the_batch_between_steps_is_refused_at_the_next_backward_and_export(tmp_path):
    private = _private()
    x = _step(private)
    private.model.seen_mean.copy_(x.mean(0))  # the raw batch's mean, in the user's loop
    with pytest.raises(ModelStateChangedError, match="'seen_mean' was written between private steps"):
        private.export(str(tmp_path / "out"))
    x2, y2 = next(iter(private.data_loader))
    with pytest.raises(ModelStateChangedError, match="seen_mean"):
        private.backward(x2, target=y2)
    assert not (tmp_path / "out" / "model.pt").exists()


def test_post_processing_of_the_released_weights_is_accepted_inside_its_block(tmp_path):
    private = _private()
    _step(private)
    with private.post_processing() as model, torch.no_grad():
        model.net[0].weight.clamp_(-0.5, 0.5)  # a projection of the released weights
    private.export(str(tmp_path / "out"))
    _step(private)
    assert private.steps_taken == 2


def test_export_into_another_runs_folder_is_refused_without_overwrite(tmp_path):
    out = str(tmp_path / "out")
    first = _private(noise_multiplier=0.5)
    _step(first)
    first.export(out)
    eps_first = json.loads((tmp_path / "out" / "privacy.json").read_text())["epsilon"]
    second = _private(noise_multiplier=4.0)
    _step(second)
    with pytest.raises(ValueError, match="holds the export of another run.*overwrite=True"):
        second.export(out)
    assert json.loads((tmp_path / "out" / "privacy.json").read_text())["epsilon"] == eps_first
    first.export(out)  # the same run exports again: its own folder
    second.export(out, overwrite=True)
    assert json.loads((tmp_path / "out" / "privacy.json").read_text())["epsilon"] < eps_first


def test_save_over_another_runs_checkpoint_is_refused_without_overwrite(tmp_path):
    path = str(tmp_path / "state.pt")
    first = _private()
    _step(first)
    first.save(path)
    first.save(path)  # its own file
    second = _private()
    with pytest.raises(ValueError, match="holds a file this run did not write.*overwrite=True"):
        second.save(path)
    second.save(path, overwrite=True)
    resumed = _private()
    resumed.resume(path)
    resumed.save(path)  # a continuation writes over the state it continues
    assert resumed.steps_taken == 0


class Shrinking(Dataset):
    def __init__(self):
        self.x, self.y = _data().tensors
        self.rows = list(range(N))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.x[self.rows[i]], self.y[self.rows[i]]


def test_a_data_set_that_shrinks_mid_run_is_refused_by_name():
    data = Shrinking()
    private = _private(dataset=data)
    _step(private)
    del data.rows[-10:]
    with pytest.raises(ValueError, match=r"had 64 examples when the run was made and has 54 now"):
        _step(private)


def test_a_data_loader_given_as_the_data_set_is_refused_with_the_fix():
    loader = DataLoader(_data(), batch_size=8)
    with pytest.raises(
        TypeError, match=r"a DataLoader was given; give its map-style Dataset \(loader.dataset\)"
    ):
        _private(dataset=loader)
