"""``nn.Conv1d``/``nn.Conv2d``: the linear rule on the unfolded input (T = output positions,
d = C_in/groups·kernel), one linear layer per group; padding modes other than zeros are applied
to the recorded input first."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpmf.optim.clipping_layers.linear import LinearHandler
from dpmf.optim.clipping_layers.registry import clipping_layer


def _conv_padded(m, x):
    """The input padded as the convolution pads it (any padding mode, 'same' included)."""
    k = len(m.kernel_size)
    if m.padding_mode != "zeros":  # the forward pads by this list, kept on the instance
        pads = list(m._reversed_padding_repeated_twice)
    elif isinstance(m.padding, str):
        pads = [0] * (2 * k)
        if m.padding == "same":  # PyTorch puts the odd element on the right / bottom
            for i in range(k):
                total = m.dilation[i] * (m.kernel_size[i] - 1)
                j = 2 * (k - 1 - i)
                pads[j], pads[j + 1] = total // 2, total - total // 2
    else:
        pads = [q for p in reversed(m.padding) for q in (p, p)]
    if not any(pads):
        return x
    return F.pad(x, pads, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)


@clipping_layer(nn.Conv1d, nn.Conv2d)
class ConvHandler(LinearHandler):
    """``nn.Conv1d``/``nn.Conv2d``: the linear rule on the unfolded input, per group."""

    name = "conv"

    def dims(self, module, call):
        k = 1
        for s in module.kernel_size:
            k *= s
        m = module
        return call.grad[0, 0].numel(), m.in_channels // m.groups * k, m.out_channels // m.groups

    def form(self, module, call):
        m, x, g = module, call.inputs[0], call.grad
        b = x.shape[0]
        x = _conv_padded(m, x)
        if isinstance(m, nn.Conv1d):
            x, g = x.unsqueeze(-2), g.unsqueeze(-2)
            kernel, stride, dilation = (1, *m.kernel_size), (1, *m.stride), (1, *m.dilation)
        else:
            kernel, stride, dilation = m.kernel_size, m.stride, m.dilation
        cols = F.unfold(x, kernel, dilation=dilation, stride=stride)  # (b, C_in·k, L)
        grp = m.groups
        a = cols.reshape(b, grp, -1, cols.shape[-1]).transpose(2, 3)  # (b, g, L, d)
        gg = g.reshape(b, grp, g.shape[1] // grp, -1).transpose(2, 3)  # (b, g, L, p)
        return a, gg

    def weight_per_example(self, module, call, dtype):
        """Per-example weight gradients by one grouped convolution backward with the examples
        as groups (no unfolded input is formed)."""
        m = module
        x, g = _conv_padded(m, call.inputs[0].to(dtype)), call.grad.to(dtype)
        b = x.shape[0]
        xi = x.reshape(1, b * x.shape[1], *x.shape[2:])
        gi = g.reshape(1, b * g.shape[1], *g.shape[2:])
        shape = (b * m.out_channels, m.in_channels // m.groups, *m.kernel_size)
        w = torch.ops.aten.convolution_backward(
            gi,
            xi,
            torch.empty(shape, dtype=dtype, device=x.device),
            None,
            list(m.stride),
            [0] * len(m.kernel_size),
            list(m.dilation),
            False,
            [0] * len(m.kernel_size),
            b * m.groups,
            [False, True, False],
        )[1]
        return w.reshape(b, *m.weight.shape)

    def bias_per_example(self, module, call, dtype):
        g = call.grad
        return g.to(dtype).reshape(g.shape[0], g.shape[1], -1).sum(-1)
