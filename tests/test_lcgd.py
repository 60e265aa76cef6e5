"""DP-λCGD (C⁻¹ = Toep(1, −λ)): sensitivity and errors against dense computations, its noise
stream against the dense C⁻¹Z with one past vector of state, λ optimization against a grid,
and the commands that list it."""

import json

import numpy as np
import pytest

from dpmf.cli import main
from dpmf.mechanisms import Participation, evaluate, factorize, lcgd, optimize_lcgd, sensitivity
from dpmf.mechanisms.structured import DenseLowerTriangular
from dpmf.pick import candidate_specs
from dpmf.workloads import Schedule, from_schedule, prefix_sum

PARTS = [
    Participation.single(),
    Participation.separated(min_sep=4, max_participations=3),
    Participation.fixed_epochs(4, 3),
]


def _dense_errors(A, Cinv, sens):
    B = A @ Cinv
    rows = np.linalg.norm(B, axis=1)
    return sens * rows.max(), sens * np.sqrt(np.mean(rows**2))


@pytest.mark.parametrize("lam", [0.0, 0.3, 0.8])
@pytest.mark.parametrize("part", PARTS, ids=lambda p: p.label)
def test_sensitivity_and_errors_equal_the_dense_computation(lam, part):
    n = 12
    for w in (prefix_sum(n), from_schedule(Schedule("cosine", 0.1), n)):
        f = factorize(w, f"lcgd:{lam}")
        C = np.array([[lam ** (i - j) if i >= j else 0.0 for j in range(n)] for i in range(n)])
        Cinv = np.eye(n) - lam * np.eye(n, k=-1)
        assert np.allclose(f.C.dense(), C) and np.allclose(f.C_inverse.dense(), Cinv)
        # brute force over every admissible set of the dense C (exhaustive search)
        ref = sensitivity(DenseLowerTriangular(C), part)
        assert ref.exact
        ev = evaluate(f, part, with_lower_bound=False)
        assert ev.sensitivity == pytest.approx(ref.value, rel=1e-10)
        mx, mean = _dense_errors(w.dense(), Cinv, ref.value)
        assert ev.max_se == pytest.approx(mx, rel=1e-10) and ev.mean_se == pytest.approx(mean, rel=1e-10)


def test_errors_equal_the_dense_computation_at_n_256():
    w = from_schedule(Schedule("exponential", 0.1), 256)
    f = factorize(w, "lcgd:0.6")
    ev = evaluate(f, with_lower_bound=False)
    C = f.C.dense()
    mx, mean = _dense_errors(w.dense(), np.linalg.inv(C), np.linalg.norm(C, axis=0).max())
    assert ev.max_se == pytest.approx(mx, rel=1e-9) and ev.mean_se == pytest.approx(mean, rel=1e-9)


def test_noise_stream_is_dense_cinv_z_and_holds_one_past_vector():
    torch = pytest.importorskip("torch")
    from dpmf.optim.noise import noise_for_factorization

    n, d = 20, 7
    f = lcgd(prefix_sum(n), 0.45)
    noise = noise_for_factorization(f, d, seed=3, dtype=torch.float64)
    assert noise.documented_state_numel == d  # one past raw vector
    Z = np.stack([noise.raw_noise(t).numpy() for t in range(n)])
    got = np.stack([noise.next().numpy() for _ in range(n)])
    assert np.allclose(got, f.C_inverse.dense() @ Z, atol=1e-12)


def test_lcgd_opt_is_never_worse_than_the_best_lambda_on_a_grid():
    for part in (Participation.single(), Participation.fixed_epochs(8, 4)):
        w = from_schedule(Schedule("linear", 0.2), 32)
        res = optimize_lcgd(w, part)
        grid = [
            evaluate(lcgd(w, lam), part, with_lower_bound=False).mean_se for lam in np.linspace(0, 0.99, 34)
        ]
        assert res.value <= min(grid) + 1e-12
        assert res.factorization.label == "lcgd_opt" and 0.0 <= res.lam < 1.0
        again = evaluate(factorize(w, "lcgd_opt", participation=part), part, with_lower_bound=False)
        assert again.mean_se == pytest.approx(res.value, rel=1e-12)


def test_parse_and_validation():
    with pytest.raises(ValueError, match="lambda"):
        factorize(prefix_sum(4), "lcgd:1.0")
    with pytest.raises(ValueError, match="lambda"):
        factorize(prefix_sum(4), "lcgd:x")
    with pytest.raises(ValueError, match="needs lambda"):
        factorize(prefix_sum(4), "lcgd")
    assert factorize(prefix_sum(4), "lcgd:0.25").label == "lcgd:0.25"


def test_commands_list_and_accept_lcgd(tmp_path, capsys):
    assert "lcgd_opt" in candidate_specs(Schedule("constant"), 64, 8, optimized=True, dense_max_steps=64)
    argv = ["curves", "--schedule", "constant", "--n", "16,32", "--factorizations", "lcgd:0.5,lcgd_opt"]
    assert main(argv + ["--out", str(tmp_path / "c")]) == 0
    text = (tmp_path / "c" / "curves.csv").read_text()
    assert "lcgd:0.5" in text and "lcgd_opt" in text
    capsys.readouterr()
    argv = ["epsilon", "--scheme", "fixed_order", "--factorization", "lcgd:0.5", "--dataset-size", "100"]
    argv += ["--batch-size", "10", "--epochs", "2", "--noise-multiplier", "2", "--delta", "1e-5", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    f = factorize(prefix_sum(20), "lcgd:0.5")
    s = sensitivity(f.C, Participation.fixed_epochs(10, 2)).value
    assert out["factorization"] == "lcgd:0.5" and out["sensitivity"] == pytest.approx(s, rel=1e-12)
