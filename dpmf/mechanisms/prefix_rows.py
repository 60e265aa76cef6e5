"""Row norms of B = A₁·diag(w)·Toep(g): learning-rate workloads at any n.

When w has a shift-separable form (``shift_basis``: polynomial and cosine schedules) the row
norms are direct sums of squares computed by streamed recurrences, O(n·R²)
(``_row_norms_separable``). When w is an inverse power a + b·(j + 1)^{−γ} and g is long, the
cross terms below come from an exponential sum for the power, O(n·R) (``power_rows``).
Otherwise, O(n log² n), as follows.

Row i of B is x_iᵀ·Toep(g) with x_i = w ⊙ 1_{≤i}, so with M = Toep(g)·Toep(g)ᵀ

    r_i = ‖B_i‖² = r_{i−1} + 2w_i·y_i + w_i²·Σ_{k≤i} g_k²,   y_i = Σ_{l<i} w_l M_{il},

and M_{il} = Σ_{m≤l} g_{i−m}g_{l−m} gives, with q = i − m and k = l − m,

    y_i = Σ_{0≤k<q≤i} g_k g_q w_{i−(q−k)}.

The pairs (k, q) are split by divide and conquer on [0, P) (P a power of two): a node [lo, hi)
with midpoint mid takes the pairs k ∈ [lo, mid), q ∈ [mid, hi), which add

* to rows i ∈ [mid, hi) (only q ≤ i): Σ_{q∈[mid,i]} g_q z(i − q) with
  z(a) = Σ_{k∈[lo,mid)} g_k w_{a+k} — a correlation, then a causal convolution;
* to rows i ≥ hi (every q): Σ_δ u(δ) w_{i−δ}, u(δ) = Σ_{q−k=δ} g_k g_q (a cross-correlation);
  summed over the nodes of a level that end before row i's block (a running sum over nodes),
  one convolution per block of rows.

Each level costs O(P log P) by batched FFTs (direct products for the smallest blocks), so
O(n log² n) in all with O(n) memory: per node three real transforms of size 2s, whose even
bins are the transforms of size s that the rows mid..hi−1 need, three of size s and one
inverse of size 2s for the later rows. A level skips the nodes whose midpoint is at or after
row n (they feed only rows beyond it), and the node that row n cuts, or whose next block it
cuts, is done at the transform sizes its rows need, so padding n up to P costs little (at
n = 10⁷, P = 2²⁴, the top three levels would otherwise transform 1.7·10⁷-point blocks for
1.6·10⁶ rows). When g has p < n non-zero
coefficients (a banded noise) the recursion covers [0, p) and every later row gets
Σ_δ ρ_δ w_{i−δ}, ρ the autocorrelation
of g: O(n log n + p log² p). The same sums over n terms the O(n·p) row-by-row recursion adds,
in another order: round-off O(ε·log n) relative per term, no cancellation beyond what the
row norms themselves carry.
"""

from __future__ import annotations

import numpy as np
from scipy import fft as sfft

from dpmf.mechanisms._fft import fftconvolve
from dpmf.mechanisms.power_rows import inverse_power_form, power_cross_terms
from dpmf.mechanisms.shift_basis import ShiftSeparable, shift_separable

__all__ = ["prefix_row_norms_sq"]

_DIRECT_MAX = 8  # blocks up to this size use direct products (FFT overhead dominates)
_CHUNK = 1 << 16  # elements per batched call: temporaries small enough to be reused


def _level_direct(g, w, s, y):
    """One level of the recursion with direct products (small s), over chunks of nodes (the
    running sum over nodes carried from one chunk to the next)."""
    h = s // 2
    N = g.shape[0] // s
    carry = np.zeros(s)  # Σ of u over the nodes before the chunk
    step = max(1, _CHUNK // s)
    for a in range(0, N, step):
        b = min(N, a + step)
        G = g[a * s : b * s].reshape(b - a, s)
        W = w[a * s : b * s].reshape(b - a, s)
        Y = y[a * s : b * s].reshape(b - a, s)
        gL, gR = G[:, :h], G[:, h:]
        z = np.zeros((b - a, h))
        for j in range(h):
            z += gL[:, j : j + 1] * W[:, j : j + h]
        part = np.zeros((b - a, h))
        for u in range(h):
            part[:, u:] += gR[:, u : u + 1] * z[:, : h - u]
        Y[:, h:] += part
        u_ = np.zeros((b - a, s))  # u(δ), δ = 0..s−1
        for j in range(h):
            u_[:, h - j : s - j] += gL[:, j : j + 1] * gR
        V = np.cumsum(u_, axis=0) + carry
        prev = np.concatenate([carry[None, :], V[:-1]])  # block c gets V of node c − 1
        carry = V[-1].copy()
        lo = a * s - s
        win = w[max(lo, 0) : b * s]
        if lo < 0:
            win = np.concatenate([np.zeros(-lo), win])
        for d in range(1, s):
            # rows of block c get V[c−1, δ]·w[c·s + t − δ]
            shifted = win[s - d : s - d + (b - a) * s].reshape(b - a, s)
            Y += prev[:, d : d + 1] * shifted


def _rows(n_rows: int, width: int) -> int:
    return max(1, _CHUNK // max(width, 1)) if n_rows else 1


def _within_exact(g, w, y, lo, h, m):
    """The rows mid..m−1 (m < lo + 2h) of a node [lo, lo + 2h) cut by the last row, at the
    smallest transform sizes those rows need (a level's last node: about half the work of the
    top levels when n is not near a power of two)."""
    mid = lo + h
    T = m - mid
    if T <= 0:
        return
    F1 = sfft.next_fast_len(h + T - 1, real=True)  # z(t), t < T: w[lo : lo + h + T − 1]
    z = sfft.irfft(
        np.conj(sfft.rfft(g[lo:mid], F1)) * sfft.rfft(w[lo : lo + h + T - 1], F1), F1, overwrite_x=True
    )[:T]
    F2 = sfft.next_fast_len(2 * T - 1, real=True)
    y[mid:m] += sfft.irfft(sfft.rfft(g[mid:m], F2) * sfft.rfft(z, F2), F2, overwrite_x=True)[:T]


def _feed_exact(v, w, y, lo, s, m):
    """Rows hi..m−1 of block [hi, hi + s) (hi = lo + s, m < hi + s) get Σ_δ v(δ)·w_{i−δ}, v
    (shape (s,)) the running sum of u over the nodes up to [lo, hi), at the smallest transform
    size free of wrap-around for those rows."""
    hi = lo + s
    T = m - hi
    if T <= 0:
        return
    F3 = sfft.next_fast_len(s + T, real=True)
    y[hi:m] += sfft.irfft(sfft.rfft(v, F3) * sfft.rfft(w[lo:m], F3), F3, overwrite_x=True)[s : s + T]


def _node_cut_feed(g, w, y, lo, s, m, carry):
    """A node [lo, lo + s) alone in its chunk whose next block is cut by row m: its rows
    mid..hi−1 and u at size s (no transform of size 2s), then ``_feed_exact``. ``carry``: the
    spectrum (size 2s) of the running sum of u over the earlier nodes, or None."""
    h = s // 2
    mid, hi = lo + h, lo + s
    cGL = np.conj(sfft.rfft(g[lo:mid], s))
    GR = sfft.rfft(g[mid:hi], s)
    z = sfft.irfft(cGL * sfft.rfft(w[lo:hi], s), s, overwrite_x=True)[:h]
    Z = sfft.rfft(z, s)
    Z *= GR
    y[mid:hi] += sfft.irfft(Z, s, overwrite_x=True)[:h]
    GR *= cGL
    v = np.roll(sfft.irfft(GR, s, overwrite_x=True), h)  # u(δ) = Σ_{q−k=δ} g_k g_q
    if carry is not None:
        v += sfft.irfft(carry, 2 * s)[:s]
    _feed_exact(v, w, y, lo, s, m)


def _level_fft(g, w, s, y, m):
    """One level of the recursion (blocks of s, nodes that reach row m − 1 = n − 1 at most),
    with batched real FFTs. Per node three transforms of size 2s (g's halves and w's block,
    zero-padded in one reused buffer) and their even bins, which are the transforms of size s:
    the rows mid..hi−1 (a correlation and a causal convolution) at size s, free of
    wrap-around; the shifted cross-correlation u is conj(ĝ_L)·ĝ_R·(−i)^f (a shift by s/2), its
    running sum over nodes is taken on the spectra, and a window w[(b−1)s : (b+1)s] has the
    spectrum ŵ_{b−1} + (−1)^f·ŵ_b: one inverse transform of size 2s for the later rows. A
    level's last node, when the last row cuts it and it is alone in its chunk, is done at the
    sizes its rows need (``_within_exact``, ``_feed_exact``)."""
    h = s // 2
    n_all = -(-m // s)  # blocks holding rows < m
    n_use = -(-(m - h) // s) if m > h else 0  # nodes with a row mid..hi−1 below m
    G = g[: n_all * s].reshape(n_all, s)
    W = w[: n_all * s].reshape(n_all, s)
    Y = y[: n_all * s].reshape(n_all, s)
    L = 2 * s
    f = np.arange(s + 1)
    shift = (-1j) ** (f % 4)  # e^{−2πi f h/L}
    sign = np.where(f % 2 == 0, 1.0, -1.0)  # e^{−2πi f s/L}
    step = _rows(n_all, L)
    alone = step == 1
    pad = np.zeros((min(step, max(n_use, 1)), L))  # [h:L) or [s:L) stay zero
    carry = np.zeros(s + 1, dtype=np.complex128)  # Σ of the spectra of u over earlier nodes
    for a in range(0, n_use, step):
        b = min(n_use, a + step)
        last_block = min(b, n_all - 1)  # blocks a+1..last_block get the later rows
        if alone and b * s > m and last_block == a:  # cut by row m, feeds nothing
            _within_exact(g, w, y, a * s, h, m)
            continue
        if alone and last_block > a and (a + 2) * s > m:  # feeds a block cut by row m
            _node_cut_feed(g, w, y, a * s, s, m, carry if a > 0 else None)
            continue
        buf = pad[: b - a]
        buf[:, :h] = G[a:b, :h]
        GL = sfft.rfft(buf, axis=1)
        buf[:, :h] = G[a:b, h:]
        GR = sfft.rfft(buf, axis=1)
        buf[:, :s] = W[a:b]
        Wf = sfft.rfft(buf, axis=1)
        buf[:, h:s] = 0.0
        cGL = np.conj(GL, out=GL)
        # z(t) = Σ_j gL_j w_{lo+j+t}, t < h (size s: even bins); rows mid..hi−1 get
        # Σ_{q≤i} g_q z(i − q)
        z = sfft.irfft(cGL[:, ::2] * Wf[:, ::2], s, axis=1, overwrite_x=True)[:, :h]
        Z = sfft.rfft(z, s, axis=1)
        Z *= GR[:, ::2]
        Y[a:b, h:] += sfft.irfft(Z, s, axis=1, overwrite_x=True)[:, :h]
        if last_block <= a:
            continue
        # V_c = Σ_{c' ≤ c} û_{c'}; rows of block c+1 get irfft(V_c · window spectrum)
        k = last_block - a
        V = np.multiply(cGL[:k], GR[:k], out=cGL[:k])
        V *= shift
        np.cumsum(V, axis=0, out=V)
        V += carry
        carry = V[-1].copy()
        if last_block < b:
            nxt = Wf[1 : k + 1] * sign
        else:
            buf[:1, :s] = W[b : b + 1]
            nxt = np.concatenate([Wf[1:], sfft.rfft(buf[:1], axis=1)])
            buf[:1, :s] = 0.0
            nxt *= sign
        nxt += Wf[:k]
        nxt *= V
        Y[a + 1 : last_block + 1] += sfft.irfft(nxt, L, axis=1, overwrite_x=True)[:, s:]


def _cross_terms(g: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y_i = Σ_{0≤k<q≤i} g_k g_q w_{i−(q−k)}, shape (len(w),); g of any length ≤ len(w)."""
    n = w.shape[0]
    p = g.shape[0]
    P = 1
    while P < p:
        P *= 2
    gp = np.zeros(P)
    gp[:p] = g
    wp = np.zeros(P)
    m = min(n, P)
    wp[:m] = w[:m]
    y = np.zeros(P)
    s = 2
    while s <= P:
        # nodes that start at or after row m only feed rows ≥ m: the level stops before them
        L = min(P, -(-m // s) * s)
        if s <= _DIRECT_MAX:
            _level_direct(gp[:L], wp[:L], s, y[:L])
        else:
            _level_fft(gp[:L], wp[:L], s, y[:L], m)
        s *= 2
    out = np.zeros(n)
    out[:m] = y[:m]
    if n > P:  # every pair complete: the autocorrelation of g
        rho = fftconvolve(g[::-1], g)[p - 1 :]  # rho[δ] = Σ_k g_k g_{k+δ}
        rho[0] = 0.0
        out[P:] = fftconvolve(rho, w)[P:n]
    return out


_POWER_MIN_BANDS = 4096  # below this the divide and conquer over g's pairs is as fast
_STREAM = 1 << 15  # entries per chunk of the streamed recurrences (running sums carried over)


def _stirling_factorial(top: int) -> np.ndarray:
    """U[s, k] = S(s, k)·k! (Stirling numbers of the second kind): j^s = Σ_k U[s, k]·binom(j, k)."""
    U = np.zeros((top + 1, top + 1))
    U[0, 0] = 1.0
    for s_ in range(1, top + 1):
        for k in range(1, s_ + 1):
            U[s_, k] = k * (U[s_ - 1, k] + U[s_ - 1, k - 1])
    return U


def _pair_weights(form: ShiftSeparable) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The pairs r ≤ r' and the coefficients of 2^{[r≠r']}·φ_rφ_{r'} in the kernel basis:
    binom(j, k), k = 0..2Q, for a polynomial (real); e^{imπτ_j}, m = 0, 1, 2 for a cosine
    (complex; m < 0 are the conjugates). Shape (pairs, K)."""
    P = form.phi_coefficients()
    R = P.shape[0]
    pairs = [(r, s_) for r in range(R) for s_ in range(r, R)]
    rows = []
    for r, s_ in pairs:
        prod = np.convolve(P[r], P[s_]) * (1.0 if r == s_ else 2.0)
        if form.kind == "polynomial":
            top = prod.shape[0] - 1
            h = float(form.n - 1)
            U = _stirling_factorial(top)
            mono = prod * h ** -np.arange(top + 1, dtype=np.float64)  # coefficients of j^s
            rows.append(mono @ U)
        else:
            rows.append(prod[2:])  # m = 0, 1, 2 of m = −2..2
    return pairs, np.array(rows)


def _row_norms_separable(g: np.ndarray, form: ShiftSeparable) -> np.ndarray:
    """‖B_i‖² when w_{m+a} = Σ_r φ_r(m)ψ_r(a) (``shift_basis``): entry (i, j) of B is
    Σ_{k≤i−j} w_{j+k}g_k = Σ_r φ_r(j)·Ψ_r(i−j) with Ψ_r(L) = Σ_{k≤L} ψ_r(k)g_k, so

        ‖B_i‖² = Σ_{r,r'} Σ_{j≤i} (φ_rφ_{r'})(j)·(Ψ_rΨ_{r'})(i−j).

    The products φ_rφ_{r'} lie in a basis whose convolutions are recurrences: binom(j, k)
    (generating function x^k/(1−x)^{k+1}: k + 1 running sums, nested by Horner's rule) for a
    polynomial schedule, e^{imπτ_j} (Σ_j e^{imπτ_j}F(i−j) = e^{imπτ_i}·Σ_{d≤i} e^{−imπτ_d}F(d))
    for a cosine. One pass over n in chunks with the running sums carried: O(n·R²) time,
    O(n) memory. A sum of squares formed directly (no running sum of increments that cancel),
    so its round-off is relative to the row norms themselves."""
    n, p = form.n, g.shape[0]
    pairs, A = _pair_weights(form)
    R = form.rank
    K = A.shape[1]
    poly = form.kind == "polynomial"
    out = np.empty(n)
    psi_carry = np.zeros(R)
    level_carry = np.zeros(K)  # polynomial: the running sum of each Horner level
    mod_carry = np.zeros(K, dtype=np.complex128)  # cosine: Σ e^{−imπτ_d}F_m(d) so far
    for lo in range(0, n, _STREAM):
        hi = min(n, lo + _STREAM)
        m = hi - lo
        Psi = np.empty((R, m))
        if lo < p:
            gc = np.zeros(m)
            top = min(hi, p)
            gc[: top - lo] = g[lo:top]
            for r in range(R):
                Psi[r] = np.cumsum(form.psi(r, lo, hi) * gc)
                Psi[r] += psi_carry[r]
                psi_carry[r] = Psi[r, -1]
        else:
            Psi[:] = psi_carry[:, None]
        prods = np.empty((len(pairs), m))
        for i, (r, s_) in enumerate(pairs):
            np.multiply(Psi[r], Psi[s_], out=prods[i])
        if poly:
            F = A.T @ prods  # (K, m): F_k = Σ_pairs A[pair, k]·Ψ_rΨ_{r'}
            G = F[K - 1]
            for k in range(K - 2, -1, -1):  # G ← F_k + (x/(1−x))·G
                cs = np.cumsum(G)
                ex = np.empty(m)
                ex[0] = level_carry[k]
                ex[1:] = cs[:-1] + level_carry[k]
                level_carry[k] += cs[-1]
                G = F[k] + ex
            cs = np.cumsum(G) + level_carry[K - 1]
            level_carry[K - 1] = cs[-1]
            out[lo:hi] = cs
        else:
            F = A.T @ prods  # (3, m) complex: F_0 (real), F_1, F_2
            acc = np.cumsum(F[0].real) + mod_carry[0].real
            mod_carry[0] = acc[-1]
            cos_t, sin_t = form.trig(lo, hi)
            first = cos_t - 1j * sin_t  # e^{−iπτ_d}
            for mm in (1, 2):
                phase = first if mm == 1 else first * first
                cs = np.cumsum(phase * F[mm]) + mod_carry[mm]
                mod_carry[mm] = cs[-1]
                acc += 2.0 * (np.conj(phase) * cs).real
            out[lo:hi] = acc
    return out


def prefix_row_norms_sq(w, g) -> np.ndarray:
    """‖B_i‖² for B = A₁·diag(w)·Toep(g) (n×n), shape (n,) (module docstring).

    Cost: O(n log n) when w is shift-separable (a polynomial of degree ≤ 4 or a cosine in the
    step, ``shift_basis``; the learning-rate schedules but exponential decay's, which has its
    own path, inverse_power and fractional powers) or g is short; O(n·R), R ≈ 60–250
    exponential terms, for inverse_power (``power_rows``); O(n log² n) otherwise (the
    polynomial schedule with a fractional power).

    Args:
        w: the column scale of A₁ (learning-rate multipliers times C⁻¹'s row scale), shape (n,).
        g: the first p ≤ n coefficients of C⁻¹ (the rest zero), shape (p,).
    """
    w = np.asarray(w, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)
    n = w.shape[0]
    g = g[:n]
    form = shift_separable(w)
    if form is not None:
        return _row_norms_separable(g, form)
    y = None
    if g.shape[0] > max(_POWER_MIN_BANDS, n // 16):  # a short g: the pairs are few
        power = inverse_power_form(w)
        y = None if power is None else power_cross_terms(w, g, power)
    if y is None:
        y = _cross_terms(g, w)
    return np.cumsum(2.0 * w * y + w * w * _squares_prefix(g, n))


def _squares_prefix(g: np.ndarray, n: int) -> np.ndarray:
    """D_i = Σ_{k≤i} g_k², shape (n,), as the total less the tail Σ_{k>i} g_k².

    The tails are summed from the far end (the small terms first), so each D_i carries one
    rounding of the total instead of the i roundings of a running sum from the front. The
    recurrence r_i = r_{i−1} + 2w_i·y_i + w_i²·D_i cancels most of w_i²·D_i against 2w_i·y_i,
    so a running sum's drift (about i·ε) accumulated over n rows: 5e-8 relative in the last
    row norm of an inverse-power schedule at n = 10⁶, against 1e-10 from the tails."""
    sq = np.zeros(n + 1)
    p = min(g.shape[0], n)
    sq[:p] = g[:p] * g[:p]
    tail = np.cumsum(sq[::-1])[::-1]  # tail[i] = Σ_{k≥i} g_k²
    return tail[0] - tail[1:]
