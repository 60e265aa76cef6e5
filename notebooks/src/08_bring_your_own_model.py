# %% [markdown]
# # 08 · Bring your own model: correlated noise in your own PyTorch loop
#
# **Question.** How do I train *my* model — not one of `dpmf.train.models` — with correlated
# noise and DP-Muon in my own training loop, read ε as training goes, and is that the same
# mechanism as `dpmf train`?
#
# `dpmf.make_private` takes the model, the optimizer and the data set and returns one object: its
# `data_loader` draws the batches of the accounted scheme, `backward` computes the private
# gradient (per-example gradients, clipping, sum, the step's correlated noise, division by the
# expected batch size) and `get_epsilon` accounts the steps taken. The model here is a small
# transformer encoder that reads an 8×8 digit (scikit-learn's digits) as a sequence of 8 rows.

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DPMF_NOTEBOOK_SIZE", "full")
EPOCHS = 2 if SIZE == "small" else 12
BATCH, EPSILON, DELTA = 128, 4.0, 1e-5
SEED = 7  # a given seed makes the run reproducible (and its noise predictable); omit it in production

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dpmf
from dpmf.optim import DPMuon, route_parameters
from dpmf.train.data import load_dataset
from dpmf.train.loop import evaluate
from dpmf.workloads import Schedule

torch.manual_seed(0)
data = load_dataset("digits")
rows = lambda x: x.reshape(x.shape[0], 8, 8)  # noqa: E731  (an image is a sequence of 8 rows)
train_set = TensorDataset(rows(data.train_x), data.train_y)


class RowEncoder(nn.Module):
    """Token embedding + one self-attention block + MLP (pre-LayerNorm), mean-pooled."""

    def __init__(self, width=32, classes=10):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.position = nn.Parameter(0.02 * torch.randn(8, width))
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x) + self.position
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        h = h + self.proj(att @ v)
        h = h + self.mlp(self.norm2(h))
        return self.head(h.mean(dim=-2))


model = RowEncoder()
print(sum(p.numel() for p in model.parameters()), "parameters")

# %% [markdown]
# The whole private part is one call. DP-Muon (Newton–Schulz on the 2-D weights, DP-SGD with
# momentum on the vectors) is a dpmf optimizer; any `torch.optim` optimizer works the same way.
# The strategy is a banded square root (`bsr:4`) under cyclic Poisson sampling, with an
# exponential learning-rate decay that the strategy is built for.

# %%
optimizer = DPMuon(route_parameters(model), lr=0.2, vector_lr=1.0)
private = dpmf.make_private(
    model, optimizer, train_set, loss_fn=F.cross_entropy, batch_size=BATCH, epochs=EPOCHS,
    target_epsilon=EPSILON, target_delta=DELTA, factorization="bsr:4", scheme="cyclic_poisson",
    schedule=Schedule("exponential", 0.1), seed=SEED,
)
print(f"σ = {private.noise_multiplier:.4f}, sensitivity {private.plan.sensitivity:.4f}, "
      f"{private.plan.steps} steps of {len(private.data_loader)} per epoch")

history = []
for epoch in range(EPOCHS):
    for x, y in private.data_loader:  # the user's loop, unchanged but for backward
        private.backward(x, target=y)
        private.optimizer.step()
        private.optimizer.zero_grad()
    _, acc = evaluate(model, rows(data.test_x), data.test_y, batch_size=512, device="cpu")
    history.append((epoch + 1, private.get_epsilon(), acc))
    print(f"epoch {epoch + 1}: ε = {history[-1][1]:.3f}, test accuracy {100 * acc:.1f} %")

# %%
fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
ax[0].plot([h[0] for h in history], [h[1] for h in history], "o-")
ax[0].set(xlabel="epoch", ylabel="ε spent (δ = 1e-5)", title="privacy, accounted online")
ax[1].plot([h[0] for h in history], [100 * h[2] for h in history], "o-", color="C1")
ax[1].set(xlabel="epoch", ylabel="test accuracy (%)", title="RowEncoder with DP-Muon, bsr:4")
fig.tight_layout()

# %% [markdown]
# `export` writes what may be shared — the weights and the privacy ledger — and none of the
# secrets (the seed, the noise buffers, the sampler state):

# %%
import json
import tempfile

out = tempfile.mkdtemp()
weights, ledger = private.export(out)
print(json.dumps({k: v for k, v in json.load(open(ledger)).items() if k in
                  ("protects", "epsilon", "delta", "accountant", "guarantee", "scheme", "strategy",
                   "noise_multiplier", "steps_taken", "noise_seed")}, indent=1))

# %% [markdown]
# **The same mechanism as `dpmf train`.** For a model that `dpmf train` knows (the MLP), the
# same configuration and seed through `make_private` in a hand-written loop and through
# `dpmf.train.train` give bit-identical weights:

# %%
from dpmf.train.config import TrainConfig
from dpmf.train.models import build_model
from dpmf.train.run import build_optimizer, sub_seed, train

cfg = TrainConfig(dataset="digits", model="mlp", optimizer="dp-muon", factorization="bsr:4",
                  scheme="cyclic_poisson", epochs=2, batch_size=BATCH, epsilon=EPSILON, delta=DELTA,
                  schedule="exponential", beta=0.1, seed=SEED, device="cpu")
reference = train(cfg, tempfile.mkdtemp(), progress=False, log=lambda *a: None)

mlp = build_model("mlp", data.input_shape, data.num_classes, seed=sub_seed(SEED, 0))
own = dpmf.make_private(
    mlp, build_optimizer(cfg, mlp, log=lambda *a: None), TensorDataset(data.train_x, data.train_y),
    loss_fn=F.cross_entropy, batch_size=BATCH, epochs=2, target_epsilon=EPSILON, target_delta=DELTA,
    factorization="bsr:4", scheme="cyclic_poisson", schedule=Schedule("exponential", 0.1), seed=SEED,
)
for _epoch in range(2):
    for x, y in own.data_loader:
        own.backward(x, target=y)
        own.optimizer.step()
        own.optimizer.zero_grad()
diff = max((a - b).abs().max().item() for a, b in zip(reference.model.parameters(), mlp.parameters(), strict=True))
print(f"dpmf train: ε = {reference.privacy.epsilon:.6f}, test accuracy {100 * reference.test_accuracy:.2f} %")
print(f"own loop:   ε = {own.get_epsilon():.6f}; largest weight difference {diff:.1e}")
assert diff == 0.0

# %% [markdown]
# **Reading.** The loop needed four statements beyond a plain PyTorch loop (`make_private`,
# `backward`, `step`, `zero_grad`), ε was available after every epoch, and the hand-written loop
# is the same mechanism as `dpmf train`: the same seed gave the same weights to the last bit, and
# the same ε. An `optimizer.step()` after a plain `loss.backward()` would have been refused.
