"""One run, one key: a checkpoint resumes as its run's continuation (same hyperparameters, same
data, every example compared) or as a declared fork, whose noise is its own from the fork on
and whose ε is accounted with its siblings' (σ/√m)."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from gpt2_helpers import DictData, private_run
from torch import nn
from torch.utils.data import Dataset

import dpmf
from dpmf.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.torch

N, B, D = 64, 16, 6


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g), torch.randint(0, 3, (N,), generator=g)


class Records(Dataset):
    """A map-style data set that is not a TensorDataset (one record can be replaced)."""

    def __init__(self, replace=None):
        self.x, self.y = _tensors()
        self.x = self.x.clone()
        if replace is not None:
            self.x[replace] += 1.0

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _private(
    dataset=None, lr=0.1, seed=None, factorization="bsr:2", scheme="cyclic_poisson", loss_fn=F.cross_entropy
):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 3))
    private = dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        Records() if dataset is None else dataset,
        loss_fn=loss_fn,
        batch_size=B,
        epochs=2,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization=factorization,
        scheme=scheme,
        seed=seed,
    )
    return private


def _steps(private, k):
    done = 0
    while done < k:
        for x, y in private.data_loader:
            private.backward(x, target=y, return_loss=False)
            private.optimizer.step()
            private.optimizer.zero_grad()
            done += 1
            if done == k:
                return
    return


def _grads(private):
    """The private gradient of the next step (without stepping)."""
    x, y = next(iter(private.data_loader))
    private.backward(x, target=y, return_loss=False)
    return torch.cat([p.grad.reshape(-1) for p in private.model.parameters()])


@pytest.fixture
def saved(tmp_path):
    private = _private()
    _steps(private, 3)
    path = str(tmp_path / "state.pt")
    private.save(path)
    return path


def test_a_continuation_repeats_the_same_noise_and_trajectory(saved):
    a, b = _private(), _private()
    a.resume(saved)
    b.resume(saved)
    assert torch.equal(_grads(a), _grads(b))  # the same release: a repeated continuation leaks nothing


def test_a_fork_setting_its_own_lr_after_resume_is_refused_at_the_first_backward(saved):
    fork = _private()
    fork.resume(saved)
    for g in fork.optimizer.param_groups:
        g["lr"] = 0.05
    x, y = next(iter(fork.data_loader))
    with pytest.raises(ValueError, match=r"group 0's lr: 0\.1 → 0\.05.*fork=True"):
        fork.backward(x, target=y)
    assert fork.steps_taken == 3


def test_an_optimizer_built_with_other_hyperparameters_is_refused_at_resume(saved):
    with pytest.raises(ValueError, match=r"group 0's momentum: 0\.9 → 0\.5"):
        private = _private()
        private.optimizer.param_groups[0]["momentum"] = 0.5
        private.resume(saved)


def _smoothed(output, target):  # a script's own loss: compared by its code
    return F.cross_entropy(output, target, label_smoothing=0.1)


@pytest.mark.parametrize(
    "other",
    [
        functools.partial(F.cross_entropy, label_smoothing=0.1),
        nn.CrossEntropyLoss(label_smoothing=0.1),
        lambda output, target: F.cross_entropy(output, target, label_smoothing=0.1),
        _smoothed,
    ],
    ids=["partial", "module", "lambda", "function"],
)
def test_a_continuation_with_another_loss_is_refused_and_a_fork_may_change_it(saved, other):
    """The same noise on another loss's gradients: the two continuations' difference would be
    noiseless, so only a fork (new noise) may change the loss."""
    with pytest.raises(ValueError, match=r"the loss changed \(saved 'torch\.nn\.functional\.cross_entropy'"):
        _private(loss_fn=other).resume(saved)
    same = _private(loss_fn=nn.CrossEntropyLoss())  # another callable: compared by its settings
    with pytest.raises(ValueError, match="the loss changed"):
        same.resume(saved)
    fork = _private(loss_fn=other)
    fork.resume(saved, fork=True)
    assert fork.steps_taken == 3
    again = _private()  # the run's own loss: a continuation
    again.resume(saved)
    assert again.steps_taken == 3


def test_loss_identities_of_equal_losses_agree_and_of_others_differ():
    from dpmf.train.continuation import loss_identity

    assert loss_identity(nn.CrossEntropyLoss(label_smoothing=0.1)) == loss_identity(
        nn.CrossEntropyLoss(label_smoothing=0.1)
    )
    assert loss_identity(nn.CrossEntropyLoss()) != loss_identity(nn.CrossEntropyLoss(label_smoothing=0.1))
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))
    assert loss_identity(weighted) != loss_identity(nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 4.0])))
    assert loss_identity(lambda o, y: F.cross_entropy(o, y)) != loss_identity(lambda o, y: F.nll_loss(o, y))

    def smoothed(s):
        return lambda o, y: F.cross_entropy(o, y, label_smoothing=s)

    assert loss_identity(smoothed(0.1)) == loss_identity(smoothed(0.1))
    assert loss_identity(smoothed(0.1)) != loss_identity(smoothed(0.2))


def test_resume_on_one_replaced_record_is_refused(saved):
    # index 5 was not among the examples an earlier sampled digest read
    other = _private(dataset=Records(replace=5))
    with pytest.raises(ValueError, match="the training data differ"):
        other.resume(saved)


def test_declared_forks_add_independent_noise_and_compose_in_the_ledger(saved):
    plain = _private()
    plain.resume(saved)
    eps_alone = plain.get_epsilon()
    f1, f2 = _private(lr=0.05), _private(lr=0.2)
    f1.resume(saved, fork=True)
    f2.resume(saved, fork=True)
    assert load_checkpoint(saved)["secret"]["children"] == 2
    g1, g2 = _grads(f1), _grads(f2)
    # same batches and weights at the fork: the clipped sums agree, so the difference of the two
    # releases is the difference of two independent noises (std σζs·√2/B̄ per entry), not zero
    diff = (g1 - g2) * f1.plan.expected_batch_size / f1.privatizer.noise_std
    assert 0.8 * math.sqrt(2) < float(diff.std()) < 1.2 * math.sqrt(2)
    # three continuations of one state: each accounted as one run at σ/√3
    led = f2.ledger()
    assert led["siblings"] == 3 and led["run_id"] != f1.ledger()["run_id"]
    expected = f2.plan.with_noise(1.0 / math.sqrt(3)).epsilon_after(f2.steps_taken, delta=1e-5).epsilon
    assert led["epsilon"] == pytest.approx(expected, rel=1e-9) and led["epsilon"] > eps_alone


def test_a_fork_with_the_checkpoints_own_seed_is_refused(tmp_path):
    private = _private(seed=7)
    _steps(private, 2)
    private.save(str(tmp_path / "s.pt"))
    fork = _private(seed=7)
    with pytest.raises(ValueError, match="the fork would repeat its noise"):
        fork.resume(str(tmp_path / "s.pt"), fork=True)


def test_a_forks_checkpoint_resumes_its_own_noise(tmp_path, saved):
    fork = _private(lr=0.05)
    fork.resume(saved, fork=True)
    _steps(fork, 1)
    path = str(tmp_path / "fork.pt")
    fork.save(path)
    expected = _grads(fork)
    again = _private(lr=0.05)
    again.resume(path)
    assert torch.equal(_grads(again), expected)
    assert again.ledger()["siblings"] == 2


# -- make_private: resume into another (reordered) data set -----------------------------------------
# resume/load_state_dict refuse another data set of the same size whatever its type: a data digest
# kept only for a TensorDataset (None for a dict data set, as Hugging Face data usually is) would let
# the same examples in another order through, which moves each person to another index and so to
# other steps of the sampler (under cyclic schemes, past min-sep). The docstring promises
# "ValueError: … another plan or data".
def test_resume_refuses_a_reordered_dict_data_set(tmp_path):
    first = private_run()
    first.backward(next(iter(first.data_loader)), return_loss=False)
    first.optimizer.step()
    path = str(tmp_path / "run.pt")
    first.save(path)
    reordered = private_run(data=DictData(order=range(31, -1, -1)))
    with pytest.raises(ValueError, match="data"):
        reordered.resume(path)
