"""What a trained model may be shipped with: its weights and its privacy ledger, no secrets.

``privacy_ledger`` describes the guarantee of the steps actually taken: the scheme, the
strategy, σ, the clip norm, the steps, (ε, δ) with its accountant and guarantee, and what the
guarantee protects. It holds no seed, no noise buffers and no sampler state (batch membership is
secret under amplified sampling). ``export`` writes ``model.pt`` (a plain state dict that loads
with ``torch.load(weights_only=True)``) and ``privacy.json`` beside it, atomically.
"""

from __future__ import annotations

import json
import os

import torch

from dpmf._io import atomic_path, atomic_write_json

__all__ = ["MODEL_FILE", "LEDGER_FILE", "PROTECTS", "check_export_folder", "privacy_ledger", "export"]

MODEL_FILE = "model.pt"
LEDGER_FILE = "privacy.json"
#: the privacy unit of single-process training
PROTECTS = "each record (training example) of the data set: adding or removing one example"


def privacy_ledger(plan, result, *, steps_taken: int, clip_norm: float, seed_given: bool) -> dict:
    """The ledger of a run (plain data; no secrets).

    Args:
        plan: the run's calibrated ``PrivatePlan``.
        result: the ``PrivacyResult`` of the steps taken.
        steps_taken: steps of the mechanism run so far (≤ ``plan.steps``).
        clip_norm: ζ.
        seed_given: whether the noise seed was given by the user (its noise is then predictable
            to whoever knows the seed) or drawn from the operating system's entropy.
    """
    eps = result.epsilon
    return {
        "protects": PROTECTS,
        "epsilon": eps if eps != float("inf") else "inf",
        "delta": result.delta,
        "accountant": result.accountant,
        "guarantee": result.guarantee,
        "confidence": result.confidence,
        "method": _without_seed(result.method, result.seed),
        "scheme": plan.scheme.label,
        "strategy": plan.label,
        "noise_multiplier": plan.noise_multiplier,
        "clip_norm": float(clip_norm),
        "sensitivity": plan.sensitivity,
        "noise_std_on_sum": plan.noise_std(clip_norm),
        "dataset_size": plan.dataset_size,
        "batch_size": plan.batch_size,
        "expected_batch_size": plan.expected_batch_size,
        "sampling_rate": plan.sampling_rate,
        "steps_taken": int(steps_taken),
        "steps_planned": plan.steps,
        "schedule": plan.schedule.name,
        "beta": plan.schedule.beta,
        "noise_seed": "given (noise predictable to whoever knows it)"
        if seed_given
        else "drawn from OS entropy",
    }


def _without_seed(method: str, seed: int | None) -> str:
    """``method`` without the Monte Carlo seed it names: a run with a given seed samples its
    accountant with that seed, which is also the noise key, so the shared ledger must not
    carry it."""
    return method if seed is None else method.replace(f"seed {seed}", "seed withheld")


def export(
    out_dir: str, model: torch.nn.Module, ledger: dict, *, weights: dict | None = None
) -> tuple[str, str]:
    """Write ``out_dir/model.pt`` (the weights, on CPU) and ``out_dir/privacy.json``.

    Args:
        weights: the whole weights to write in place of ``model.state_dict()`` (a fully_shard
            model's, gathered by every rank: ``dpmf.train.models.whole_state``).

    Returns:
        the two paths.
    """
    os.makedirs(out_dir, exist_ok=True)
    weights = model.state_dict() if weights is None else weights
    weights = {k: v.detach().cpu().clone() for k, v in weights.items()}
    model_path = os.path.join(out_dir, MODEL_FILE)
    with atomic_path(model_path) as tmp:
        torch.save(weights, tmp)
    ledger_path = os.path.join(out_dir, LEDGER_FILE)
    atomic_write_json(ledger_path, ledger)
    return model_path, ledger_path


def check_export_folder(out_dir: str, run_id: str, *, overwrite: bool = False) -> None:
    """Refuse to export run ``run_id`` into a folder holding another run's export.

    A folder with no ``model.pt`` and no ``privacy.json``, or whose ledger has this ``run_id``
    (a later export of the same run, a continuation's), is accepted.

    Raises:
        ValueError: ``out_dir`` holds an export of another run (or one without a readable
            ledger) and ``overwrite`` is False; the message names the folder and the fix.
    """
    ledger_path = os.path.join(out_dir, LEDGER_FILE)
    found = [n for n in (MODEL_FILE, LEDGER_FILE) if os.path.exists(os.path.join(out_dir, n))]
    if overwrite or not found:
        return
    theirs = None
    try:
        with open(ledger_path, encoding="utf-8") as fh:
            theirs = json.load(fh).get("run_id")
    except (OSError, ValueError, AttributeError):
        pass
    if theirs != run_id:
        raise ValueError(
            f"out_dir={out_dir!r} is invalid: it holds the export of another run ({', '.join(found)}), "
            "whose privacy ledger would be lost; choose another folder, or pass overwrite=True to replace it"
        )
