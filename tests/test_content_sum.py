"""The parameter checksum of the model-state check (``content_sum``): its value against an
independent sum of the bytes, and a write that a float64 sum misses."""

import numpy as np
import pytest
import torch
from torch import nn

from dpmf.optim.model_guard import (
    ModelStateChangedError,
    check_state_unchanged,
    content_sum,
    state_versions,
)

pytestmark = pytest.mark.torch


def bytes_sum(t: torch.Tensor) -> int:
    """The sum mod 2⁶⁴ of the little-endian 64-bit words of t's bytes (a last partial word
    as the integer of its bytes), from Python integers."""
    raw = bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())
    return sum(int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)) % (1 << 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 7, 8, 33])
def test_the_checksum_is_the_word_sum_of_the_bytes_and_sees_every_single_entry_write(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 1e3).to(dtype)
    assert content_sum(x) == bytes_sum(x)
    base = content_sum(x)
    for i in range(n):  # the smallest change of each entry, one at a time
        y = x.clone()
        y[i] = torch.nextafter(y[i : i + 1].float(), torch.tensor([np.inf])).to(dtype)
        if torch.equal(y, x):  # the next float32 rounds back to this dtype's value
            y[i] = -y[i] if y[i] != 0 else torch.tensor(1.0, dtype=dtype)
        assert content_sum(y) != base, (dtype, n, i)


def test_a_non_contiguous_parameter_is_summed_as_its_entries():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert content_sum(x.t()) == bytes_sum(x.t())


def test_a_data_write_below_the_float64_sums_last_bit_is_refused():
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.weight[0, 0] = 1e-30
    before = state_versions(model)
    model.weight.data[0, 0] = 2e-30  # no version bump
    # the premise: a float64 sum of the entries does not see this write
    assert float(model.weight.sum(dtype=torch.float64)) == 11.0 + 1e-30
    with pytest.raises(ModelStateChangedError, match="'weight'"):
        check_state_unchanged(model, before, "the test's write", 0)


def test_an_unchanged_model_with_nan_entries_passes_the_check():
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.bias[0] = float("nan")
    before = state_versions(model)
    check_state_unchanged(model, before, "nothing", 0)


def test_kept_word_views_give_the_same_sums_after_writes_and_replaced_storage():
    from dpmf.optim.model_guard import WordViews

    views = WordViews()
    lin = nn.Linear(5, 3)  # weight: 15 float32 entries (a last partial word)
    p = lin.weight
    assert views.sum(p) == content_sum(p) == bytes_sum(p)
    p.data[1, 2] += 1.0  # a write through .data: the kept view sees the memory itself
    assert views.sum(p) == content_sum(p) == bytes_sum(p)
    p.data = torch.randn(3, 5)  # other memory: the view is made again
    assert views.sum(p) == content_sum(p) == bytes_sum(p)
    p.data = torch.randn(5, 3, dtype=torch.float64)  # other shape and dtype
    assert views.sum(p) == content_sum(p) == bytes_sum(p)
    q = torch.randn(4)
    views.sum(q)
    views.prune()
    views.sum(p)
    views.prune()  # q was not summed since the last prune: its view is dropped
    assert [e[0] for e in views._views.values()] == [p]


def test_sums_with_layouts_read_the_kept_views_only_while_tensors_and_layouts_hold():
    from dpmf.optim.model_guard import WordViews

    def layouts(ts):
        return [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in ts]

    views = WordViews()
    a, b = torch.randn(4, 3), torch.randn(5)  # b: a last partial word
    ts = [a, b, a]  # a tied tensor listed twice
    assert views.sums(ts, layouts(ts)) == [bytes_sum(a), bytes_sum(b), bytes_sum(a)]
    a.data[1, 1] += 1.0  # the same tensors and layouts: the kept views read the memory again
    b.data[4] -= 2.0
    assert views.sums(ts, layouts(ts)) == [bytes_sum(a), bytes_sum(b), bytes_sum(a)]
    a.data = a.data.clone().t()  # other memory, not contiguous: no word view for it
    assert views.sums(ts, layouts(ts)) == [bytes_sum(a), bytes_sum(b), bytes_sum(a)]
    a.data[2, 0] += 1.0  # unchanged layouts again: the new memory is read, not the old view's
    assert views.sums(ts, layouts(ts)) == [bytes_sum(a), bytes_sum(b), bytes_sum(a)]
    c = torch.randn(4, 3)
    assert views.sums([c, b, c], layouts([c, b, c]))[0] == bytes_sum(c)  # other tensors
    views.prune()
    views.sums([b], layouts([b]))
    views.prune()  # a and c were not summed since the last prune: nothing of theirs is kept
    assert views._last is not None and views._last[0] == [b]
    assert [e[0] for e in views._views.values()] == [b]


def test_content_mark_sees_data_writes_storage_swaps_and_reshapes_of_a_gradient():
    from dpmf.optim.model_guard import ContentMark

    g = torch.randn(4, 3)
    mark = ContentMark(g)
    assert mark.unchanged(g)
    old = float(g[2, 1])
    g.data[2, 1] += 1.0  # through .data: the version of g is unchanged
    assert g._version == 0 and not mark.unchanged(g)
    g.data[2, 1] = old  # the same bits again
    assert mark.unchanged(g)
    h = torch.randn(4, 3)
    mark = ContentMark(h)
    h.data = h.data.clone()  # other memory, same values
    assert not mark.unchanged(h)
    k = torch.randn(3, 3)
    mark = ContentMark(k)
    k.data = k.data.t()  # same memory and shape, other layout
    assert not mark.unchanged(k)
    k2 = torch.randn(6)
    mark = ContentMark(k2)
    k2.add_(0.0)  # an in-place write: the version moves
    assert not mark.unchanged(k2)
