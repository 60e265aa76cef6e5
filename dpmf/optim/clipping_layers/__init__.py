"""The clipping-layer registry: per-example squared norms and clipped sums of one layer kind.

Ghost clipping and book-keeping (``dpmf.optim.ghost``) need, for each module owning trainable
parameters, the squared norm of each example's gradient restricted to those parameters and,
given the clip factors c, the sum Σ_i c_i·g_i — from the module's recorded inputs and output
gradients, without a per-example backward. A **handler** says how for one module type;
``register_clipping_layer(module_type, handler)`` or the ``@clipping_layer(module_type)``
class decorator adds one (``registry``). A module is matched by its exact
type, else by its nearest registered base class whose ``forward`` it does not override (a
subclass that changes the forward, or the ``_conv_forward`` it calls, is not the registered
layer); then the handler's ``check`` may still decline it (for instance a sparse embedding). A
module with a forward hook (its own or a global one: it may change the output whose gradient
the handler's formulas take), or a method of its class shadowed on the instance (accelerate's
hooks replace ``module.forward``) has none. Replacing torch's or dpmf's own code
(``F.linear = …``, ``nn.Linear.forward = …``) is the trainer's code, trusted, and not looked
for. During a recorded forward the engine also checks, at each call of a registered layer, that no hook ran
before its own and that the instance's attributes are those of when the handler was chosen.
Modules without a handler take the ``torch.func`` path of ``dpmf.optim.ghost`` (per module, or
for the whole model).

Built-in handlers (one module each, registered through the same decorator):

- ``nn.Linear``: s = aWᵀ + b on T tokens; ‖G_iᵀA_i‖² as a ghost norm ⟨A_iA_iᵀ, G_iG_iᵀ⟩ when
  T²(d + p) < T·p·d, else the per-example gradient instantiated (the mixed rule of Bu et al.,
  NeurIPS 2022, §3.2; Li et al., ICLR 2022, §4); the sum (c∘G)ᵀA (Bu et al., ICML 2023, Alg. 1).
- ``nn.Conv1d``/``nn.Conv2d``: the same on the unfolded input, one linear layer per group.
- transformers' ``Conv1D`` (GPT-2; s = aW + b with W of shape (d, p)): the linear rule with
  the weight transposed; registered by its qualified name so that transformers is never
  imported here.
- ``nn.Embedding``: ‖Σ_t e_{x_t}G_i[t]‖² = Σ_{t,u}[x_t = x_u]⟨G_i[t], G_i[u]⟩ (the sparse
  per-example gradient beyond 16 tokens per example); not for ``sparse`` or
  ``scale_grad_by_freq`` embeddings (their gradients couple the batch's token counts).
- ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``: the affine gradients Σ_t G∘x̂ and Σ_t G,
  instantiated per example.
- transformers' ``T5LayerNorm``/``LlamaRMSNorm``, BART's scaled word and learned positional
  embeddings, and T5's relative position bias (a **batch adapter** on ``T5Attention`` gives the
  bias one row per example; ``register_batch_adapter``), by qualified name (``hf_layers``).

A handler implements ``per_example`` (instantiated per-example gradients; the default norms and
sums are taken from them) or, for a cheaper closed form, ``sq_norms`` and ``clipped_sum``.
Every handler that can also instantiate its per-example gradients supports tied parameters
(one parameter used by several registered layers, e.g. GPT-2's input and output embeddings):
the per-example gradient of such a parameter is the sum of its uses, instantiated (a weight
tied between one ``nn.Embedding`` and one ``nn.Linear`` has its own closed form instead,
``dpmf.optim.ghost_tied``).

Modules: ``norms`` (the shared numerical kernels), ``registry`` (the handler base class, the
registry and its lookup), one module per built-in layer family (``linear``, ``conv``,
``embedding``, ``norm``, ``hf_layers``).
"""

from __future__ import annotations

from dpmf.optim.clipping_layers import conv, embedding, hf_layers, linear, norm  # noqa: F401  (register)
from dpmf.optim.clipping_layers.conv import ConvHandler
from dpmf.optim.clipping_layers.embedding import EmbeddingHandler, most_repeated
from dpmf.optim.clipping_layers.linear import Conv1DHandler, LinearHandler
from dpmf.optim.clipping_layers.norm import NormHandler
from dpmf.optim.clipping_layers.norms import PendingNorm, row_norms, squares, weighted_sum
from dpmf.optim.clipping_layers.registry import (
    ClippingHandler,
    batch_adapter,
    clipping_handler,
    clipping_layer,
    mark_builtin,
    register_batch_adapter,
    register_clipping_layer,
    registered_clipping_layers,
)

mark_builtin()

__all__ = [
    "ClippingHandler",
    "Conv1DHandler",
    "ConvHandler",
    "EmbeddingHandler",
    "LinearHandler",
    "NormHandler",
    "PendingNorm",
    "batch_adapter",
    "clipping_handler",
    "clipping_layer",
    "most_repeated",
    "register_batch_adapter",
    "register_clipping_layer",
    "registered_clipping_layers",
    "row_norms",
    "squares",
    "weighted_sum",
]
