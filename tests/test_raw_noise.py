"""Raw noise drawn where the parameters live: torch's CPU twister with its state set from the
subkey (checked against Python's own MT19937 and a Box–Muller brute force), keyed and
W-invariant, the generator recorded in checkpoints and a resume that would change the numbers
refused."""

import random

import numpy as np
import pytest
import torch
from scipy import stats

from dpmf.mechanisms import factorize
from dpmf.optim.noise import ChunkedKeys, noise_for_factorization
from dpmf.optim.raw_noise import TorchTwister, device_generator, generator_named, subkey
from dpmf.workloads import prefix_sum

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = 2**200 + 17


def _python_twister(gen: TorchTwister) -> random.Random:
    """Python's MT19937 in the state dpmf gave torch's generator (index 624: a twist first)."""
    r = random.Random()
    r.setstate((3, tuple(int(w) for w in gen._words) + (624,), None))
    return r


def test_cpu_noise_is_torchs_twister_in_the_subkeys_state_and_box_muller_of_its_numbers():
    gen = device_generator("cpu")
    assert gen.name == "torch-mt19937"
    n = 1600  # a multiple of 16: torch's vectorised Box–Muller pairs u[j:j+8] with u[j+8:j+16]
    z = torch.empty(n, dtype=torch.float64)
    gen.fill(z, subkey(KEY, 3))
    r = _python_twister(gen)
    # torch.randn(float64) takes 53-bit uniforms from two 32-bit words; float32 below
    z32 = torch.empty(n)
    gen.fill(z32, subkey(KEY, 3))
    u = np.array([(r.getrandbits(32) & (2**24 - 1)) * 2.0**-24 for _ in range(n)])
    ref = np.empty(n)
    for j in range(0, n, 16):
        radius = np.sqrt(-2.0 * np.log(1.0 - u[j : j + 8]))
        theta = 2.0 * np.pi * u[j + 8 : j + 16]
        ref[j : j + 8], ref[j + 8 : j + 16] = radius * np.cos(theta), radius * np.sin(theta)
    np.testing.assert_allclose(z32.numpy(), ref, atol=2e-5)
    assert not torch.equal(z.float(), z32)  # float64 numbers are their own draw


def test_raw_noise_is_a_function_of_the_subkey_and_standard_normal():
    gen = device_generator("cpu")
    a, b, c = (torch.empty(200_000) for _ in range(3))
    gen.fill(a, subkey(KEY, 0))
    gen.fill(b, subkey(KEY, 1))
    device_generator("cpu").fill(c, subkey(KEY, 0))  # another generator object, same numbers
    assert torch.equal(a, c) and not torch.equal(a, b)
    for z in (a, b):
        assert stats.kstest(z.double().numpy(), "norm").pvalue > 1e-4
    assert abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 0.01  # 0 ± 4.5 standard errors


def test_subkeys_differing_in_the_high_bits_give_other_numbers():
    gen = device_generator("cpu")
    a, b = torch.empty(64), torch.empty(64)
    gen.fill(a, 5)
    gen.fill(b, 5 + (1 << 100))
    assert not torch.equal(a, b)


def test_a_streams_noise_is_the_same_at_any_split_of_the_parameters():
    sizes = (70_000, 3, 40_000)
    full_keys = ChunkedKeys(sizes, chunk=65_536)
    strategy = factorize(prefix_sum(6), "identity")
    full = noise_for_factorization(strategy, full_keys.dim, seed=KEY, keys=full_keys)
    part_keys = ChunkedKeys(sizes, (0, 2), 65_536)
    part = noise_for_factorization(strategy, part_keys.dim, seed=KEY, keys=part_keys)
    z, zp = full.raw_noise(4), part.raw_noise(4)
    assert torch.equal(zp, torch.cat([z[:70_000], z[70_003:]]))


def _stream(generator=None):
    gen = noise_for_factorization(factorize(prefix_sum(6), "identity"), 50, seed=KEY)
    if generator is not None:
        gen.use_generator(generator)
    return gen


def test_checkpoints_record_the_generator_and_resume_with_it():
    a = _stream()
    a.next()
    state = a.state_dict()
    assert state["fingerprint"]["generator"] == "torch-mt19937"
    b = _stream()
    b.load_state_dict(state)
    assert torch.equal(a.next(), b.next())
    # a checkpoint of an earlier version names no generator: numpy's Philox, resumed as it was
    old = _stream("numpy-philox")
    old.next()
    legacy = old.state_dict()
    del legacy["fingerprint"]["generator"]
    resumed = _stream()
    resumed.load_state_dict(legacy)
    assert resumed.generator.name == "numpy-philox"
    assert torch.equal(old.next(), resumed.next())


def test_a_resume_that_would_change_the_numbers_is_refused_in_one_line():
    state = _stream().state_dict()
    state["fingerprint"]["generator"] = "torch-philox-cuda-132sm"
    with pytest.raises(ValueError, match="CUDA generator; resume on a CUDA device") as err:
        _stream().load_state_dict(state)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="made on the CPU"):
        generator_named("torch-mt19937", "meta")
    with pytest.raises(ValueError, match="noise_generator='philox' is invalid: must be one of"):
        generator_named("philox", "cpu")


def test_execution_flags_name_the_generator():
    from dpmf.step import ExecutionFlags
    from dpmf.train.config import TrainConfig

    assert ExecutionFlags().noise_generator == "device"
    with pytest.raises(ValueError, match="noise_generator"):
        ExecutionFlags(noise_generator="mt")
    cfg = TrainConfig(dataset="digits", noise_generator="numpy-philox")
    assert cfg.execution_flags().noise_generator == "numpy-philox"
    assert "noise_generator" not in cfg.run_identity()  # the checkpoint's noise names it
    with pytest.raises(ValueError, match="noise_generator='mt' is invalid: must be one of device"):
        TrainConfig(dataset="digits", noise_generator="mt")


def test_a_step_built_with_a_named_generator_draws_with_it():
    import torch.nn.functional as F

    from dpmf.plan import PrivatePlan
    from dpmf.seeds import SeedPolicy
    from dpmf.step import ExecutionFlags, build

    plan = PrivatePlan(64, 16, steps=4, noise_multiplier=1.0, clip_norm=1.0)
    model = torch.nn.Linear(3, 2)
    seed = SeedPolicy.adopt(9, given=True)
    default = build(plan, model, F.cross_entropy, seed=seed)
    numpy_one = build(plan, model, F.cross_entropy, ExecutionFlags(noise_generator="numpy-philox"), seed=seed)
    assert default.noise.generator.name == "torch-mt19937"
    assert numpy_one.noise.generator.name == "numpy-philox"
    assert not torch.equal(default.noise.raw_noise(0), numpy_one.noise.raw_noise(0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_noise_is_made_on_the_device_and_keyed():
    gen = device_generator("cuda")
    assert gen.name.startswith("torch-philox-cuda-")
    a, b = torch.empty(10_000, device="cuda"), torch.empty(10_000, device="cuda")
    gen.fill(a, subkey(KEY, 0))
    gen.fill(b, subkey(KEY, 0))
    assert torch.equal(a, b)
    assert stats.kstest(a.double().cpu().numpy(), "norm").pvalue > 1e-4
    # the offset carries the subkey's high bits
    gen.fill(b, subkey(KEY, 0) ^ (1 << 100))
    assert not torch.equal(a, b)
