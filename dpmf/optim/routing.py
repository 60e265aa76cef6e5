"""Explicit routing of a model's parameters to the update rules of the DP optimizers.

Routing (the DP-Muon paper, Sec. Method, item 3):

==========================================  =================================================
parameter                                   rule
==========================================  =================================================
2-D weights, conv kernels (≥ 2-D, read as   ``matrix_rule`` (default "matrix": the
out × in·kh·kw)                             optimizer's matrix rule, "muon" for DPMuon)
1-D and 0-D (biases, norm scales)           ``vector_rule`` (default "vector": the
                                            optimizer's vector rule, "sgd" for DPMuon)
embedding tables (nn.Embedding[Bag])        ``embeddings`` (None: routed like any matrix)
the output head (``head_names``, or the     ``head`` (None: routed like the rest); its 1-D
last nn.Linear of the model)                parameters too unless ``head`` is a matrix rule
anything named in ``rules``                 that rule
==========================================  =================================================

The placeholders "matrix" and "vector" let the same groups serve DPSGD, DPAdam, DPMuon,
DPMuonS and DPMuonBC. Only parameters with a proper matrix view reach a matrix rule: a tensor
of two or more dimensions whose view has a single row or column (e.g. a (C, 1, 1) scale) is
refused — here for an explicit matrix rule, by the optimizer for "matrix" — with an error that
names it and the fix (``rules={name: "sgd"}``). Frozen parameters (``requires_grad=False``)
are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from dpmf._validation import check_choice
from dpmf.optim.matrix import check_matrix_parameter
from dpmf.optim.registry import matrix_rule_names, rule_names

__all__ = ["route_parameters", "rule_of"]


# The rules follow the optimizer registry (``dpmf.optim.registry``), read at each call.
def _any_rule() -> tuple[str, ...]:
    return rule_names() + ("matrix", "vector")


def _vector_rules() -> tuple[str, ...]:
    return tuple(r for r in rule_names() if r not in matrix_rule_names()) + ("vector",)


def _matrix_like() -> tuple[str, ...]:
    return matrix_rule_names() + ("matrix",)


def _named(model) -> tuple[list[tuple[str, torch.Tensor]], nn.Module | None]:
    if isinstance(model, nn.Module):
        return list(model.named_parameters()), model
    if isinstance(model, Iterable) and not isinstance(model, (str, bytes, torch.Tensor)):
        named = list(model)
        for i, item in enumerate(named):
            if (
                not isinstance(item, tuple)
                or len(item) != 2
                or not isinstance(item[0], str)
                or not isinstance(item[1], torch.Tensor)
            ):
                raise TypeError(
                    f"model is invalid: item {i} is {type(item).__name__}; expected an nn.Module "
                    "or an iterable of (name, parameter) pairs such as model.named_parameters()"
                )
        return named, None
    raise TypeError(
        f"model={type(model).__name__} is invalid: expected an nn.Module or (name, parameter) pairs"
    )


def _names_of(named, ids) -> set[str]:
    return {n for n, p in named if id(p) in ids}


def route_parameters(
    model,
    *,
    matrix_rule: str = "matrix",
    vector_rule: str = "vector",
    embeddings: str | None = None,
    head: str | None = None,
    embedding_names: Iterable[str] | None = None,
    head_names: Iterable[str] | None = None,
    rules: Mapping[str, str] | None = None,
    options: Mapping[str, Mapping] | None = None,
) -> list[dict]:
    """Split a model's trainable parameters into parameter groups, one per update rule.

    Args:
        model: an nn.Module, or (name, parameter) pairs such as ``model.named_parameters()``
            (then embeddings and the head are found only through ``embedding_names`` and
            ``head_names``).
        matrix_rule: rule of the parameters with two or more dimensions: one of ``RULES`` or
            "matrix" (the optimizer's matrix rule).
        vector_rule: rule of the 1-D/0-D parameters: "sgd", "adam" or "vector" (the
            optimizer's vector rule).
        embeddings: rule of the embedding tables, e.g. "adam" (None: routed like any matrix).
        head: rule of the output head, e.g. "adam" (None: routed like the rest).
        embedding_names: names of the embedding parameters (default: those of the model's
            nn.Embedding/nn.EmbeddingBag modules).
        head_names: names of the head's parameters (default, when ``head`` is set: those of
            the model's last nn.Linear in registration order).
        rules: explicit rule per parameter name, applied last.
        options: hyperparameters per rule, added to that rule's group, e.g.
            ``{"sgd": {"lr": 0.1, "momentum": 0.9}}``.

    Returns:
        A list of parameter groups ``{"params": [(name, tensor), …], "rule": r, **options[r]}``
        for the rules that received parameters, in order of first appearance, ready for
        ``DPSGD``/``DPAdam``/``DPMuon``/``DPMuonS``/``DPMuonBC``.

    Raises:
        TypeError: model is neither a module nor (name, parameter) pairs.
        ValueError: an unknown rule, a name in ``rules``/``head_names``/``embedding_names``
            that is not a trainable parameter, ``head`` set without a way to find the head,
            or a parameter without a proper matrix view sent to a matrix rule.
    """
    check_choice("matrix_rule", matrix_rule, _any_rule())
    check_choice("vector_rule", vector_rule, _vector_rules())
    if embeddings is not None:
        check_choice("embeddings", embeddings, _any_rule())
    if head is not None:
        check_choice("head", head, _any_rule())
    named_all, module = _named(model)
    named = [(n, p) for n, p in named_all if p.requires_grad]
    trainable = {n for n, _ in named}
    everything = {n for n, _ in named_all}

    def _check_names(label, names):
        return _checked_names(label, names, everything, trainable)

    emb = _embedding_names(named, module, embedding_names, _check_names)
    head_set = _head_names(named, module, head, head_names, _check_names)

    explicit = dict(rules or {})
    if explicit:
        _check_names("rules", explicit)
        for name, rule in explicit.items():
            check_choice(f"rules[{name!r}]", rule, _any_rule())
    opts = dict(options or {})
    for rule, values in opts.items():
        check_choice("options key", rule, _any_rule())
        if not isinstance(values, Mapping):
            raise TypeError(f"options[{rule!r}]={values!r} is invalid: must be a mapping")

    groups: dict[str, list] = {}
    for name, p in named:
        rule = _default_rule(name, p, matrix_rule, vector_rule, embeddings, emb, head, head_set)
        rule = explicit.get(name, rule)
        if rule in matrix_rule_names():
            check_matrix_parameter(name, p.shape)
        groups.setdefault(rule, []).append((name, p))
    return [{"params": params, "rule": rule, **opts.get(rule, {})} for rule, params in groups.items()]


def _checked_names(label: str, names, everything: set, trainable: set) -> set:
    """The trainable ones of ``names``.

    Raises:
        ValueError: a name that is no parameter of the model.
    """
    names = set(names)
    missing = sorted(names - everything)
    if missing:
        raise ValueError(f"{label} is invalid: {missing} are not parameters of the model")
    return names & trainable


def _embedding_names(named: list, module, embedding_names, check) -> set:
    """The embedding tables' parameter names: those given, else those of the model's
    nn.Embedding/nn.EmbeddingBag modules (none for (name, parameter) pairs)."""
    if embedding_names is not None:
        return check("embedding_names", embedding_names)
    if module is None:
        return set()
    ids = {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        for p in m.parameters(recurse=False)
    }
    return _names_of(named, ids)


def _head_names(named: list, module, head, head_names, check) -> set:
    """The output head's parameter names when ``head`` is set: those given, else those of the
    model's last nn.Linear.

    Raises:
        ValueError: no way to find the head (no nn.Linear, or (name, parameter) pairs without
            ``head_names``).
    """
    if head is None:
        return set()
    if head_names is not None:
        return check("head_names", head_names)
    if module is None:
        raise ValueError(f"head={head!r} needs head_names when the model is given as (name, parameter) pairs")
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(
            f"head={head!r} is invalid for this model: it has no nn.Linear layer; "
            "name the head's parameters with head_names"
        )
    return _names_of(named, {id(p) for p in linears[-1].parameters(recurse=False)})


def _default_rule(name, p, matrix_rule, vector_rule, embeddings, emb, head, head_set):
    is_matrix = p.ndim >= 2
    special = None
    if embeddings is not None and name in emb:
        special = embeddings
    elif head is not None and name in head_set:
        special = head
    if special is not None:
        if is_matrix or special not in _matrix_like():
            return special
        return vector_rule
    return matrix_rule if is_matrix else vector_rule


def rule_of(groups: list[dict], name: str) -> str:
    """The rule of the group that holds parameter ``name`` (for inspection and tests).

    Raises:
        ValueError: no group holds ``name``.
    """
    for g in groups:
        names = g.get("param_names") or [item[0] for item in g["params"] if isinstance(item, tuple)]
        if name in names:
            return g["rule"]
    raise ValueError(f"name={name!r} is invalid: no parameter group holds it")
