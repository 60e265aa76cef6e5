"""Models whose layers are per-example safe (GroupNorm, never BatchNorm).

==========  =================================================================  ==========
name        architecture                                                       parameters
==========  =================================================================  ==========
``cnn``     small CNN for 28×28 (any size): two blocks conv3×3 stride 2 →      20 586
            GroupNorm → tanh (16, 32 channels), then a linear layer            (1×28×28,
                                                                               10 classes)
``cnn3``    the 3-block CNN of the learning-rate-scheduling experiments for     308 394
            32×32: blocks of two conv3×3 → GroupNorm → tanh and a max-pool 2,  (3×32×32)
            channels 32-32 / 64-64 / 128-128, then a linear layer
``mlp``     flatten → linear 256 → tanh → linear                               203 530
                                                                               (1×28×28)
``wrn16-4`` WideResNet-16-4 (Zagoruyko & Komodakis, 2016) with GroupNorm       2 748 890
            (16 groups) instead of BatchNorm, pre-activation blocks            (3×32×32)
==========  =================================================================  ==========

GroupNorm in place of BatchNorm is the standard choice for DP training (De et al., "Unlocking
High-Accuracy Differentially Private Image Classification through Scale", 2022), tanh the
usual activation of small DP CNNs (Papernot et al., "Tempered Sigmoid Activations for Deep
Learning with Differential Privacy", AAAI 2021).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpmf._validation import check_choice, check_int
from dpmf.train.choices import MODELS

__all__ = ["MODELS", "build_model", "SmallCNN", "ThreeBlockCNN", "MLP", "WideResNet"]


def _group_norm(channels: int, groups: int) -> nn.GroupNorm:
    g = math.gcd(channels, groups)
    return nn.GroupNorm(g, channels)


def _check_shape(input_shape) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(f"input_shape={tuple(input_shape)!r} is invalid: must be (channels, height, width)")
    c, h, w = (
        check_int(n, v, minimum=1) for n, v in zip(("channels", "height", "width"), input_shape, strict=True)
    )
    return c, h, w


class SmallCNN(nn.Sequential):
    """conv3×3/2(16) → GN → tanh → conv3×3/2(32) → GN → tanh → linear.

    Strided convolutions instead of max-pooling: a quarter of the activations after the first
    layer, so per-example gradients cost about a fifth of the pooled variant on CPU.

    Args:
        input_shape: (C, H, W), any H, W ≥ 1 (28×28 for Fashion-MNIST → 7×7 maps; 8×8 digits
            → 2×2).
        num_classes: output size.
        channels: the two convolution widths.
        groups: GroupNorm groups.
    """

    def __init__(self, input_shape=(1, 28, 28), num_classes=10, channels=(16, 32), groups=4):
        c, h, w = _check_shape(input_shape)
        c1, c2 = channels
        h2, w2 = math.ceil(math.ceil(h / 2) / 2), math.ceil(math.ceil(w / 2) / 2)
        super().__init__(
            nn.Conv2d(c, c1, 3, stride=2, padding=1),
            _group_norm(c1, groups),
            nn.Tanh(),
            nn.Conv2d(c1, c2, 3, stride=2, padding=1),
            _group_norm(c2, groups),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(c2 * h2 * w2, num_classes),
        )


class ThreeBlockCNN(nn.Sequential):
    """Three blocks [conv3×3 → GN → tanh → conv3×3 → GN → tanh → max-pool 2] of widths
    32, 64, 128, then a linear layer (H and W divisible by 8; 32×32 for CIFAR-10)."""

    def __init__(self, input_shape=(3, 32, 32), num_classes=10, widths=(32, 64, 128), groups=8):
        c, h, w = _check_shape(input_shape)
        if h % 8 or w % 8:
            raise ValueError(
                f"input_shape={tuple(input_shape)!r} is invalid for cnn3: H and W must be divisible by 8"
            )
        layers = []
        prev = c
        for width in widths:
            layers += [
                nn.Conv2d(prev, width, 3, padding=1),
                _group_norm(width, groups),
                nn.Tanh(),
                nn.Conv2d(width, width, 3, padding=1),
                _group_norm(width, groups),
                nn.Tanh(),
                nn.MaxPool2d(2),
            ]
            prev = width
        layers += [nn.Flatten(), nn.Linear(prev * (h // 8) * (w // 8), num_classes)]
        super().__init__(*layers)


class MLP(nn.Sequential):
    """flatten → [linear → tanh] per hidden width → linear."""

    def __init__(self, input_shape=(1, 28, 28), num_classes=10, hidden=(256,)):
        c, h, w = _check_shape(input_shape)
        layers: list[nn.Module] = [nn.Flatten()]
        prev = c * h * w
        for width in hidden:
            layers += [nn.Linear(prev, width), nn.Tanh()]
            prev = width
        layers.append(nn.Linear(prev, num_classes))
        super().__init__(*layers)


class _WideBlock(nn.Module):
    def __init__(self, cin, cout, stride, groups):
        super().__init__()
        self.norm1 = _group_norm(cin, groups)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm2 = _group_norm(cout, groups)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.act = nn.ReLU()
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)

    def forward(self, x):
        o = self.act(self.norm1(x))
        y = self.conv1(o)
        y = self.conv2(self.act(self.norm2(y)))
        return y + (x if self.shortcut is None else self.shortcut(o))


class WideResNet(nn.Module):
    """WideResNet-depth-k with GroupNorm: depth = 6n + 4 (16 → n = 2 blocks per stage),
    stage widths 16k, 32k, 64k (k = 4: 64, 128, 256), pre-activation blocks."""

    def __init__(self, input_shape=(3, 32, 32), num_classes=10, depth=16, width=4, groups=16):
        super().__init__()
        c, _, _ = _check_shape(input_shape)
        if (depth - 4) % 6:
            raise ValueError(f"depth={depth} is invalid: must be 6n + 4")
        n = (depth - 4) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        self.stem = nn.Conv2d(c, widths[0], 3, padding=1, bias=False)
        blocks = []
        prev = widths[0]
        for stage, w in enumerate(widths[1:]):
            for i in range(n):
                blocks.append(_WideBlock(prev, w, 2 if (stage > 0 and i == 0) else 1, groups))
                prev = w
        self.blocks = nn.Sequential(*blocks)
        self.norm = _group_norm(prev, groups)
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(prev, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        x = self.pool(self.act(self.norm(x)))
        return self.head(torch.flatten(x, 1))


def build_model(name: str, input_shape, num_classes: int, *, seed: int | None = None) -> nn.Module:
    """A fresh model ``name`` for inputs of ``input_shape`` = (C, H, W).

    Args:
        name: one of ``MODELS`` (``wrn16_4`` is accepted for ``wrn16-4``).
        input_shape: (C, H, W).
        num_classes: ≥ 2.
        seed: if given, the initial weights are drawn from ``torch.manual_seed(seed)``'s stream
            (the global torch generator is restored afterwards).

    Raises:
        ValueError: unknown name, or an input shape the architecture cannot take.
    """
    name = "wrn16-4" if name == "wrn16_4" else name
    check_choice("model", name, MODELS)
    num_classes = check_int("num_classes", num_classes, minimum=2)
    shape = tuple(input_shape)
    builders = {
        "cnn": lambda: SmallCNN(shape, num_classes),
        "cnn3": lambda: ThreeBlockCNN(shape, num_classes),
        "mlp": lambda: MLP(shape, num_classes),
        "wrn16-4": lambda: WideResNet(shape, num_classes, 16, 4),
    }
    if seed is None:
        return builders[name]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builders[name]()


def fully_shard_model(model: nn.Module) -> nn.Module:
    """Shard ``model`` with ``torch.distributed.fsdp.fully_shard`` (FSDP2) over the default
    process group: every module with parameters of its own (a layer), then the root; in place.

    Returns:
        ``model``, whose parameters are now DTensor shards (the private step's ``fsdp`` mode).
    """
    from torch.distributed.fsdp import fully_shard

    for _, m in list(model.named_modules())[1:]:
        if any(True for _ in m.parameters(recurse=False)):
            fully_shard(m)
    fully_shard(model)
    return model


def whole_state(model: nn.Module) -> dict:
    """``model.state_dict()`` with every DTensor gathered whole (every rank must call it: an
    all-gather per sharded entry)."""
    from dpmf.optim.fsdp import gathered

    return {k: gathered(v) for k, v in model.state_dict().items()}
