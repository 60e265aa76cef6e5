"""Book-keeping clipping of a plain chain of linear layers and elementwise activations, without
the general engine's hooks.

``dpmf.optim.ghost`` records each layer's input and output gradient through forward hooks, a
``Parameter`` subclass that watches every use of a trainable parameter, a one-example probe of
the layout and autograd nodes after each output: run-time checks that make any model safe to
clip. For an ``nn.Sequential`` (or a subclass that keeps its ``forward``, such as dpmf's
``MLP``) made only of ``nn.Linear`` and parameterless elementwise or flattening modules of the
exact types below, with no hook anywhere, those checks are settled by the structure itself:
Sequential calls each child once, in order, on the previous child's output; a Linear reads only
its own weight and bias; the activations read no parameter, act on each entry alone and keep
dim 0; ``Flatten`` from dim ≥ 1 keeps each example's entries in its own row. So the same
forward is run here directly, the output gradient of each Linear is taken by one
``torch.autograd.grad`` on the Linear outputs (the same backward operations as the engine's
backward towards its recording nodes), and the norms and sums are the Linear handler's own
(``_Handler``: the same tensors, the same operations, so the same bits). Each Linear's input and
output are still checked to have the examples along dim 0 (a layout the structure would
otherwise have to assume).

For small models (the federated ``record`` mode's MLP on tabular data) the engine's per-step
Python work was most of a private step's time; this path leaves the arithmetic unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module

from dpmf.optim.clipping_layers import LinearHandler, clipping_handler

__all__ = ["chain_layers", "chain_output_gradients"]

# parameterless modules that act on each entry alone (no state, no randomness)
_ELEMENTWISE = (nn.Tanh, nn.ReLU, nn.Sigmoid, nn.GELU, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Identity)


# what a call of a module runs: an instance attribute of one of these names replaces it
_CALL_ATTRS = ("forward", "_call_impl", "_wrapped_call_impl")


def _no_hooks(m: nn.Module) -> bool:
    """No hook on the module and its call not replaced on the instance."""
    if any(a in m.__dict__ for a in _CALL_ATTRS):
        return False
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _global_hooks() -> bool:
    return bool(_module._has_any_global_hook())


def _plain_child(m: nn.Module) -> bool:
    """A parameterless child of an allowed exact type, not in place, with its class's forward."""
    t = type(m)
    if m._parameters or m._buffers or m._modules or not _no_hooks(m):
        return False
    if t is nn.Flatten:
        return isinstance(m.start_dim, int) and m.start_dim >= 1
    return t in _ELEMENTWISE and not getattr(m, "inplace", False)


def chain_layers(model: nn.Module, names: list[str], named: dict):
    """The model's children, and (module, model-level weight name, bias name or None) of each
    ``nn.Linear`` in order, when the model is such a chain (see the module) whose trainable
    parameters ``names`` are exactly its Linear layers' weights and biases, each a plain
    ``nn.Parameter`` used by one layer; else None (the general engine clips it).

    Args:
        names: the trainable parameters' names (``trainable_parameters`` order).
        named: name → parameter (``named_parameters()``).
    """
    t = type(model)
    if not isinstance(model, nn.Sequential) or t.forward is not nn.Sequential.forward:
        return None
    # a subclass that changes how it is called or which children it iterates is not a chain
    if t.__call__ is not nn.Module.__call__ or t._call_impl is not nn.Module._call_impl:
        return None
    if t.__iter__ is not nn.Sequential.__iter__ or t._wrapped_call_impl is not nn.Module._wrapped_call_impl:
        return None
    if model._parameters or model._buffers or not _no_hooks(model):
        return None
    if _global_hooks():
        return None
    children = list(model._modules.items())
    own = {id(p): n for n, p in named.items()}
    linears, expected = [], []
    for _, m in children:
        if m is None:
            return None
        if type(m) is nn.Linear:
            handler, _ = clipping_handler(m)
            if type(handler) is not LinearHandler or not _no_hooks(m):
                return None
            if m._buffers or m._modules or set(m._parameters) - {"weight", "bias"}:
                return None
            params = [m.weight] + ([] if m.bias is None else [m.bias])
            if any(type(p) is not nn.Parameter or not p.requires_grad or id(p) not in own for p in params):
                return None
            qs = [own[id(p)] for p in params]
            expected += qs
            linears.append((m, qs[0], qs[1] if len(qs) > 1 else None))
        elif not _plain_child(m):
            return None
    # every trainable parameter is one Linear's, used by that layer alone, in parameter order
    if not linears or expected != list(names) or len(set(expected)) != len(expected):
        return None
    return [m for _, m in children], linears


def chain_output_gradients(children: list, inputs: torch.Tensor, loss_fn, targets, per_example_losses):
    """The forward of the chain and ∂(Σ_i ℓ_i)/∂s for each Linear output s.

    Returns:
        ([(input, output gradient) per Linear], the (b,) per-example losses, detached), or None
        when a Linear's input or output does not have the b examples along dim 0 (the general
        engine then clips the batch).
    """
    b = int(inputs.shape[0])
    h, outs, ins = inputs, [], []
    for m in children:
        if type(m) is nn.Linear:
            if h.dim() != 2 or h.shape[0] != b:
                return None
            ins.append(h.detach())
            h = m(h)
            outs.append(h)
        else:
            h = m(h)
            if h.dim() == 0 or h.shape[0] != b:
                return None
    per = per_example_losses(loss_fn, h, targets)
    if per.shape != (b,):
        return None
    grads = torch.autograd.grad(per.sum(), outs, allow_unused=True)
    if any(g is None for g in grads):
        return None
    return list(zip(ins, grads, strict=True)), per.detach()
