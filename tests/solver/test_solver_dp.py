"""DP (docs/method.md §4): segment cost, numba == numpy == brute force, lean import."""

import math
import subprocess
import sys

import numpy as np
import pytest
from scipy import integrate

from fewbit.solver import registry, weights
from fewbit.solver.dp import (
    backtrack,
    borders_cost,
    brute_force,
    dp_numba,
    dp_numba_tables,
    dp_numpy,
    prefix_integrals,
    segment_cost,
)
from fewbit.solver.objective import Objective


def _objective(name, weight="uniform", domain=(-10.0, 10.0), symmetric=False):
    sf = registry.get(name)
    return Objective(sf, sf.params(), weights.parse(weight), domain, symmetric=symmetric)


@pytest.mark.parametrize(
    "name,weight,symmetric",
    [("gelu", "uniform", False), ("silu", "normal:2.0", False), ("sigmoid", "uniform", True), ("selu", "uniform", False)],
)
def test_segment_cost_matches_direct_integration(name, weight, symmetric):
    obj = _objective(name, weight, symmetric=symmetric)
    t = obj.grid(400)
    W, FW, F2 = prefix_integrals(obj, t)
    rng = np.random.default_rng(1)
    for _ in range(12):
        j, i = sorted(rng.choice(t.size, 2, replace=False))
        lo, hi = t[j], t[i]
        pts = [p for p in obj.breakpoints if lo < p < hi]
        w = lambda x: float(obj.density(np.array([x]))[0])  # noqa: E731
        g = lambda x: float(obj.df(np.array([x]))[0])  # noqa: E731
        kw = dict(points=pts or None, limit=200, epsabs=1e-14, epsrel=1e-13)
        Wd = integrate.quad(w, lo, hi, **kw)[0]
        y = integrate.quad(lambda x: g(x) * w(x), lo, hi, **kw)[0] / Wd
        direct = integrate.quad(lambda x: (g(x) - y) ** 2 * w(x), lo, hi, **kw)[0]
        T = float(segment_cost(W, FW, F2, j, i))
        assert T == pytest.approx(direct, rel=1e-7, abs=1e-12)
        assert W[i] - W[j] == pytest.approx(Wd, rel=1e-12)


def test_segment_cost_is_clamped_nonnegative():
    # a constant derivative: every true cost is 0, rounding must not make it negative
    obj = _objective("relu", domain=(0.5, 10.0))
    W, FW, F2 = prefix_integrals(obj, obj.grid(50))
    j, i = np.triu_indices(51, 1)
    assert np.all(segment_cost(W, FW, F2, j, i) >= 0.0)


@pytest.mark.parametrize("name,weight", [("gelu", "uniform"), ("silu", "normal:3.0"), ("tanh", "uniform"), ("hardswish", "uniform")])
@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_numba_equals_numpy_equals_brute_force(name, weight, K):
    obj = _objective(name, weight, domain=(-6.0, 5.0))
    t = np.linspace(-6.0, 5.0, 15)  # 14 cells: C(13, 3) = 286 border sets for K = 4
    W, FW, F2 = prefix_integrals(obj, t)
    c_nb, b_nb = dp_numba(W, FW, F2, K)
    c_np, b_np = dp_numpy(W, FW, F2, K)
    c_bf, b_bf = brute_force(W, FW, F2, K)
    assert c_nb == pytest.approx(c_bf, rel=1e-12, abs=1e-15)
    assert c_np == pytest.approx(c_bf, rel=1e-12, abs=1e-15)
    np.testing.assert_array_equal(b_nb, b_bf)
    np.testing.assert_array_equal(b_np, b_bf)
    assert borders_cost(W, FW, F2, b_nb) == pytest.approx(c_nb, rel=1e-12, abs=1e-15)


def test_numba_equals_numpy_on_a_larger_grid_and_every_k():
    # several blocks of the numba kernel (16 rows each here; tiny grids test the in-block path), all k from one run
    obj = _objective("gelu")
    t = obj.grid(150)
    W, FW, F2 = prefix_integrals(obj, t)
    D, A = dp_numba_tables(W, FW, F2, 6)
    n = t.size - 1
    for k in range(1, 7):
        c_np, b_np = dp_numpy(W, FW, F2, k)
        assert D[n, k] == pytest.approx(c_np, rel=1e-12)
        b = backtrack(A, n, k)
        # the numba borders achieve the numpy optimum (equal borders unless an exact tie)
        assert borders_cost(W, FW, F2, b) == pytest.approx(c_np, rel=1e-12)
        np.testing.assert_array_equal(b, b_np)


def test_zero_weight_pieces_cost_nothing():
    # a histogram that leaves a gap of zero weight
    sf = registry.get("gelu")
    w = weights.histogram([-10, -1, 1, 10], [0.5, 0.0, 0.5])
    obj = Objective(sf, sf.params(), w, (-10.0, 10.0))
    W, FW, F2 = prefix_integrals(obj, obj.grid(40))
    c_nb, b_nb = dp_numba(W, FW, F2, 3)
    c_bf, _ = brute_force(W, FW, F2, 3)
    assert np.isfinite(c_nb) and c_nb == pytest.approx(c_bf, rel=1e-12)


def test_dp_input_validation():
    W = FW = F2 = np.linspace(0, 1, 4)
    with pytest.raises(ValueError, match="fewer than K=5"):
        dp_numba(W, FW, F2, 5)
    with pytest.raises(ValueError, match="K must be an integer >= 1"):
        dp_numba(W, FW, F2, 0)
    with pytest.raises(ValueError, match="equal length"):
        dp_numpy(W, FW[:3], F2, 2)
    with pytest.raises(ValueError, match="finite"):
        dp_numba(np.r_[W[:3], np.nan], FW, F2, 2)


def test_import_fewbit_does_not_import_numba_or_solver():
    code = (
        "import sys, fewbit, fewbit.table, fewbit.activations\n"
        "bad = [m for m in ('numba', 'scipy', 'fewbit.solver') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dp_from_several_threads():
    from concurrent.futures import ThreadPoolExecutor

    obj = _objective("silu")
    W, FW, F2 = prefix_integrals(obj, obj.grid(300))
    ref = dp_numpy(W, FW, F2, 4)
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda _: dp_numba(W, FW, F2, 4), range(8)))
    for c, b in results:
        assert c == pytest.approx(ref[0], rel=1e-12)
        np.testing.assert_array_equal(b, ref[1])


def test_dp_runs_in_pieces_and_stops_between_them():
    # Ctrl-C (KeyboardInterrupt) must stop a long DP within one kernel call: the kernel
    # runs in pieces and returns to Python (the progress callback) after each.
    from fewbit.solver.dp import dp_chunks

    obj = _objective("gelu")
    W, FW, F2 = prefix_integrals(obj, obj.grid(150))
    n = W.size - 1
    chunks = dp_chunks(n)
    assert len(chunks) > 2 and chunks[0][0] == 1 and chunks[-1][1] == n + 1
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    calls = []

    def stop_at_two(done, total):
        calls.append((done, total))
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dp_numba_tables(W, FW, F2, 4, progress=stop_at_two)
    assert calls == [(1, len(chunks)), (2, len(chunks))]
    # the kernel lock was released; a full run still equals the reference
    calls.clear()
    D, A = dp_numba_tables(W, FW, F2, 4, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(d, len(chunks)) for d in range(1, len(chunks) + 1)]
    c_np, b_np = dp_numpy(W, FW, F2, 4)
    assert D[n, 4] == pytest.approx(c_np, rel=1e-12)
    np.testing.assert_array_equal(backtrack(A, n, 4), b_np)


@pytest.mark.parametrize("n, k, needle", [(5, 3, "k must be an integer in \\[1, 2\\]"), (5, 0, "k must be"),
                                          (6, 1, "n must be an integer in \\[1, 5\\]"), (5, 2.0, "k must be")])
def test_backtrack_refuses_pieces_the_tables_do_not_hold(n, k, needle):
    """``k > K`` raised a bare IndexError, ``k < 1`` numpy's "negative dimensions"."""
    W = np.arange(6.0)
    FW = np.array([0, 1, 1, 2, 5, 5.0])
    F2 = np.array([0, 1, 1, 2, 11, 11.0])
    _, A = dp_numba_tables(W, FW, F2, 2)
    with pytest.raises(ValueError, match=needle):
        backtrack(A, n, k)


def test_dp_pieces_grow_with_the_work():
    """Ctrl-C is seen between kernel calls: 16 calls at grid 200000 and 8 bits (5e12 DP
    steps) had made each one minutes long, and a fit ignored Ctrl-C (review h70). Calls
    hold about 1e9 steps where the grid's blocks allow (at most one call per block: the
    last block of a 200000 grid alone is 2.6e10 steps), and as many as before where the
    work is small."""
    from fewbit.solver.dp import _block, dp_chunks

    assert dp_chunks(8000, 4) == dp_chunks(8000)  # a default fit at 2 bits: as before
    for n, k in ((40000, 256), (200000, 256)):
        chunks = dp_chunks(n, k)
        work = [(b * b - a * a) / 2 * k for a, b in chunks]
        last_block = (n * n - (n - _block(n)) ** 2) / 2 * k
        assert max(work) <= max(2e9, 2.1 * last_block), (n, max(work), last_block)
        assert chunks[0][0] == 1 and chunks[-1][1] == n + 1 and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
