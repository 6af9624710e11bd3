"""Exact dynamic programming for optimal piecewise-constant fits (docs/method.md §4).

Novikov et al., "Few-bit Backward" (ICML 2023), sec. 3 and app. G: on a grid
``A = t_0 < ... < t_n = B`` with prefix integrals

    W(i) = int_A^{t_i} w,   FW(i) = int_A^{t_i} f' w,   F2(i) = int_A^{t_i} f'^2 w,

one constant piece on ``[t_j, t_i]`` costs

    T(j, i) = F2(i) - F2(j) - (FW(i) - FW(j))^2 / (W(i) - W(j))

and ``DP(i, k) = min_{j < i} DP(j, k - 1) + T(j, i)``. The cost is not Monge for
non-monotone ``f'`` (GELU, SiLU), so no Knuth / divide-and-conquer shortcut is used: all
three implementations here evaluate the full recurrence, O(n^2 K) time.

- :func:`dp_numba`: the fast one. It visits ``i`` in blocks; for the grid points ``j``
  before a block it computes ``T(j, i)`` once per ``(i, j)`` (1/K of the divisions) and
  then, per layer, the first-index arg-min over ``j`` vectorised over 64 lanes, in
  parallel over ``i`` in the block; then it finishes the few ``j`` inside the block
  sequentially. That is the same recurrence, with the same tie-breaking.
  (One run also yields the optimum for every ``k <= K``: :func:`backtrack`.)
  The blocks are run in a few kernel calls (:func:`dp_chunks`) so that Ctrl-C stops a
  long DP promptly; the kernel writes into arrays it is given and returns nothing.
- :func:`dp_numpy`: a plain layer-by-layer numpy reference.
- :func:`brute_force`: enumerates every set of borders (tiny grids, tests).

Ties are broken towards the smallest ``j`` in all three.
"""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np
from numba import njit, prange

from fewbit._checks import check_positive_int, is_int

__all__ = [
    "segment_cost",
    "dp_numba",
    "dp_numba_tables",
    "dp_chunks",
    "backtrack",
    "dp_numpy",
    "brute_force",
    "borders_cost",
]

# Denominator floor: a piece the weight does not see (W(i) == W(j)) has FW diff 0 and costs 0.
_TINY = 1e-300
# fastmath without nnan / ninf: infeasible states are +inf and must compare correctly.
_FASTMATH = {"reassoc", "nsz", "arcp", "contract", "afn"}
# numba's default (workqueue) threading layer must not run parallel kernels concurrently.
_KERNEL_LOCK = threading.Lock()


def _block(n: int) -> int:
    """Rows per parallel region: few regions (each ends in a barrier, costly on a busy
    machine), but a small sequential in-block part (n * block / 2 * K steps)."""
    return int(min(512, max(16, n // 20)))


def _check(W, FW, F2, K):
    W = np.ascontiguousarray(W, dtype=np.float64)
    FW = np.ascontiguousarray(FW, dtype=np.float64)
    F2 = np.ascontiguousarray(F2, dtype=np.float64)
    if W.ndim != 1 or W.shape != FW.shape or W.shape != F2.shape:
        raise ValueError(f"W, FW, F2 must be 1-d of equal length, got {W.shape}, {FW.shape}, {F2.shape}")
    n = W.size - 1
    K = check_positive_int(K, "K")
    if n < K:
        raise ValueError(f"the grid has {n} cells, fewer than K={K} pieces")
    if not (np.all(np.isfinite(W)) and np.all(np.isfinite(FW)) and np.all(np.isfinite(F2))):
        raise ValueError("prefix integrals must be finite")
    return W, FW, F2, K


def segment_cost(W, FW, F2, j, i):
    """``T(j, i)`` for index arrays ``j < i`` (broadcast), clamped at 0.

    The cost of one constant piece on ``[t_j, t_i]`` (docs/method.md §4; Novikov et al.,
    ICML 2023, app. G). A piece the weight does not see (``W(i) == W(j)``) costs 0.

    Args:
        W, FW, F2: ``(n + 1,)`` prefix integrals (converted to float64).
        j, i: integer grid indices in ``0..n``, scalars or arrays of broadcastable shapes.
            ``j < i`` is not checked: a pair with ``j >= i`` gives a meaningless value
            (0 for ``j == i``).

    Returns:
        float64 array of the broadcast shape.
    """
    W, FW, F2 = (np.asarray(a, dtype=np.float64) for a in (W, FW, F2))
    dw = W[i] - W[j]
    d = FW[i] - FW[j]
    t = F2[i] - F2[j] - d * d / np.maximum(dw, _TINY)
    return np.maximum(t, 0.0)


#: Lanes of the vectorised arg-min (a multiple of the SIMD width).
_LANES = 64


@njit(parallel=True, error_model="numpy", fastmath=_FASTMATH, cache=True)
def _dp_kernel(W, FW, F2, K, block, D, A, i_begin, i_end):  # pragma: no cover - compiled
    # Fills D[:, i] and A[:, i] for the blocks starting at i0 = i_begin, i_begin + block, ...
    # below i_end; every earlier column must be final. Returns nothing: boxing a result
    # would call back into the interpreter (see dp_numba_tables).
    n = W.shape[0] - 1
    KP = K + 1
    L = 64  # == _LANES
    # D[k, j]: best cost of [t_0, t_j] with k pieces; padded columns stay +inf.
    for i0 in range(i_begin, i_end, block):
        i1 = min(i0 + block, n + 1)
        nch = (i0 + L - 1) // L
        # Part 1, j < i0 (every layer of D final), parallel over i in the block:
        # T(j, i) once per (i, j), then per layer a first-index arg-min over j, vectorised
        # as L lanes (lane l sees j = l, l + L, ...; strict < keeps the first j per lane).
        for i in prange(i0, i1):
            Wi = W[i]
            FWi = FW[i]
            F2i = F2[i]
            tt = np.empty(nch * L)
            for j in range(i0):
                d = FWi - FW[j]
                tt[j] = max(F2i - F2[j] - d * d / max(Wi - W[j], 1e-300), 0.0)
            for j in range(i0, nch * L):
                tt[j] = np.inf
            acc = np.empty(L)
            idx = np.empty(L, np.int64)
            for k in range(1, KP):
                row = D[k - 1]
                for lane in range(L):
                    acc[lane] = np.inf
                    idx[lane] = 0
                for c in range(nch):
                    base = c * L
                    for lane in range(L):
                        v = row[base + lane] + tt[base + lane]
                        m = v < acc[lane]
                        acc[lane] = v if m else acc[lane]
                        idx[lane] = base + lane if m else idx[lane]
                best = np.inf
                arg = 0
                for lane in range(L):
                    if acc[lane] < best or (acc[lane] == best and idx[lane] < arg):
                        best = acc[lane]
                        arg = idx[lane]
                D[k, i] = best
                A[k, i] = arg
        # Part 2, i0 <= j < i: inside the block, in order (j ascending keeps the first j).
        for i in range(i0 + 1, i1):
            Wi = W[i]
            FWi = FW[i]
            F2i = F2[i]
            for j in range(i0, i):
                d = FWi - FW[j]
                t = max(F2i - F2[j] - d * d / max(Wi - W[j], 1e-300), 0.0)
                for k in range(1, KP):
                    c = D[k - 1, j] + t
                    if c < D[k, i]:
                        D[k, i] = c
                        A[k, i] = j


#: Kernel calls per DP at least, where the grid has that many blocks (see :func:`dp_chunks`).
_MIN_CHUNKS = 16
#: DP steps (``j`` x ``k`` pairs) per kernel call at most, where the blocks allow: about a
#: second on one core of this project's CI machine (a fit at grid 40000 and 8 bits, 2e11
#: steps, took 200 s in 16 calls).
_STEPS_PER_CHUNK = 1e9


def dp_chunks(n: int, K: int = 1) -> list[tuple[int, int]]:
    """The ranges ``[i_begin, i_end)`` of grid rows that :func:`dp_numba_tables` computes
    per kernel call, for a grid of ``n`` cells and ``K`` pieces: whole blocks, about equal
    work each (the work of row ``i`` grows like ``i``), up to 16 of them, more where the DP's
    ``n² K / 2`` steps would make one call longer than about a second (Ctrl-C is seen
    between calls: with 16 calls, a fit at grid 200000 and 8 bits ignored it for minutes),
    at most one call per block.

    Args:
        n: number of grid cells (an int).
        K: pieces of the DP (an int >= 1).

    Returns:
        list of ``(i_begin, i_end)`` int pairs, in order, that together cover the rows
        ``1..n`` (row 0 is the initial state); ``[]`` for ``n <= 0``.
    """
    block = _block(n)
    starts = list(range(1, n + 1, block))
    nb = len(starts)
    c = min(max(_MIN_CHUNKS, math.ceil(float(n) * n * max(K, 1) / 2 / _STEPS_PER_CHUNK)), nb)
    ends = sorted({max(1, math.ceil(nb * math.sqrt(m / c))) for m in range(1, c + 1)})
    out, prev = [], 0
    for e in ends:
        if e > prev:
            out.append((starts[prev], starts[e] if e < nb else n + 1))
            prev = e
    return out


def dp_numba_tables(W, FW, F2, K, *, progress=None):
    """Full DP tables: ``D (n + 1, K + 1)`` best costs and ``A`` arg-mins (int32).

    ``D[i, k]`` is the best cost of ``[t_0, t_i]`` with exactly ``k`` pieces, so one run
    serves every ``k <= K`` (see :func:`backtrack`).

    The kernel runs in :func:`dp_chunks` pieces, returning to Python after each, so that
    Ctrl-C (``KeyboardInterrupt``) stops a long DP within one piece. The kernel writes into
    arrays allocated here and returns nothing: compiled code that returns arrays calls back
    into the interpreter to box them, and a SIGINT pending at that moment raised
    ``KeyboardInterrupt`` inside numba's boxing code (SystemError or SIGSEGV).

    Args:
        W, FW, F2: ``(n + 1,)`` float64 prefix integrals.
        K: pieces, ``1 <= K <= n``.
        progress: optional ``progress(done, total)`` called after each piece
            (``total = len(dp_chunks(n, K))``); an exception it raises stops the DP.

    Returns:
        ``(D, A)``, both of shape ``(n + 1, K + 1)`` (transposed views, not C-contiguous):
        ``D`` float64, ``+inf`` where no split exists (``k > i``, and ``k = 0 < i``),
        ``D[0, 0] = 0``; ``A`` int32, ``A[i, k]`` the start index ``j`` of the last piece
        of that best split (first minimum on ties; 0 where there is none).

    Raises:
        ValueError: for bad shapes, non-finite input, ``K < 1`` or fewer than ``K`` cells.
    """
    W, FW, F2, K = _check(W, FW, F2, K)
    n = W.size - 1
    D = np.full((K + 1, n + 1 + _LANES), np.inf)
    D[0, 0] = 0.0
    A = np.zeros((K + 1, n + 1), np.int32)
    chunks = dp_chunks(n, K)
    block = _block(n)
    with _KERNEL_LOCK:
        for done, (i_begin, i_end) in enumerate(chunks, 1):
            _dp_kernel(W, FW, F2, K, block, D, A, i_begin, i_end)
            if progress is not None:
                progress(done, len(chunks))
    return D[:, : n + 1].T, A.T


def backtrack(A: np.ndarray, n: int, k: int) -> np.ndarray:
    """Interior border indices ``(k - 1,)`` (increasing) of the best ``k``-piece split of ``[0, n]``.

    Args:
        A: the ``(n + 1, K + 1)`` arg-min table of :func:`dp_numba_tables`.
        n: the last grid index (the DP's ``n``; a smaller one gives the best split of
            ``[t_0, t_n]``).
        k: number of pieces, ``1 <= k <= min(K, n)``.

    Returns:
        int64 array ``(k - 1,)`` of indices in ``1..n-1`` (empty for ``k = 1``).

    Raises:
        ValueError: ``n`` or ``k`` outside those ranges (numpy's "negative dimensions" and a
            bare ``IndexError`` had come instead).
    """
    rows, cols = np.shape(A)
    if not (is_int(n) and 1 <= n < rows):
        raise ValueError(f"n must be an integer in [1, {rows - 1}] (A's rows - 1), got {n!r}")
    if not (is_int(k) and 1 <= k <= min(cols - 1, n)):
        raise ValueError(f"k must be an integer in [1, {min(cols - 1, n)}] (pieces: at most K and n), got {k!r}")
    out = np.empty(k - 1, dtype=np.int64)
    i = n
    for kk in range(k, 1, -1):
        i = int(A[i, kk])
        out[kk - 2] = i
    return out


def dp_numba(W, FW, F2, K):
    """Exact O(n^2 K) DP with numba (parallel over grid points, cached compilation).

    Args:
        W, FW, F2: ``(n + 1,)`` float64 prefix integrals on the grid (``W`` increasing).
        K: number of pieces, ``1 <= K <= n``.

    Returns:
        ``(cost, borders)``: the best cost (float) and the interior border indices
        ``(K - 1,)`` int64, increasing, in ``1..n-1``.

    Raises:
        ValueError: see :func:`dp_numba_tables`.
    """
    D, A = dp_numba_tables(W, FW, F2, K)
    n = W.shape[0] - 1
    return float(D[n, K]), backtrack(A, n, K)


def dp_numpy(W, FW, F2, K):
    """Plain numpy reference of :func:`dp_numba` (layer by layer, vectorised over ``j``).

    Args:
        W, FW, F2: ``(n + 1,)`` float64 prefix integrals, as :func:`dp_numba`.
        K: number of pieces, ``1 <= K <= n``.

    Returns:
        ``(cost, borders)`` as :func:`dp_numba`.

    Raises:
        ValueError: as :func:`dp_numba_tables`.
    """
    W, FW, F2, K = _check(W, FW, F2, K)
    n = W.size - 1
    D = np.full((K + 1, n + 1), np.inf)
    A = np.zeros((K + 1, n + 1), dtype=np.int64)
    D[0, 0] = 0.0
    for k in range(1, K + 1):
        for i in range(k, n + 1):
            j = np.arange(i)
            c = D[k - 1, :i] + segment_cost(W, FW, F2, j, i)
            a = int(np.argmin(c))  # first minimum
            D[k, i] = c[a]
            A[k, i] = a
    out = np.empty(K - 1, dtype=np.int64)
    i = n
    for k in range(K, 1, -1):
        i = int(A[k, i])
        out[k - 2] = i
    return float(D[K, n]), out


def borders_cost(W, FW, F2, borders) -> float:
    """Total cost of the pieces cut at grid indices ``borders`` (interior, increasing).

    Args:
        W, FW, F2: ``(n + 1,)`` prefix integrals.
        borders: interior grid indices in ``1..n-1``, strictly increasing (not checked:
            unordered or repeated indices give a meaningless cost).

    Returns:
        float: the sum of :func:`segment_cost` over the pieces.
    """
    n = len(W) - 1
    idx = np.r_[0, np.asarray(borders, dtype=np.int64), n]
    return float(segment_cost(W, FW, F2, idx[:-1], idx[1:]).sum())


def brute_force(W, FW, F2, K):
    """Enumerate every ``K``-piece split (``C(n - 1, K - 1)`` of them; tiny grids only).

    Args:
        W, FW, F2: ``(n + 1,)`` float64 prefix integrals, as :func:`dp_numba`.
        K: number of pieces, ``1 <= K <= n``.

    Returns:
        ``(cost, borders)`` with the lexicographically first optimal border set
        (float, int64 ``(K - 1,)``).

    Raises:
        ValueError: as :func:`dp_numba_tables`.
    """
    W, FW, F2, K = _check(W, FW, F2, K)
    n = W.size - 1
    best, arg = np.inf, None
    for comb in itertools.combinations(range(1, n), K - 1):
        c = borders_cost(W, FW, F2, comb)
        if c < best:
            best, arg = c, comb
    return float(best), np.asarray(arg, dtype=np.int64)


def prefix_integrals(objective, t):
    """``W, FW, F2`` (each ``(n + 1,)``, float64, from 0) on grid ``t`` for a :class:`~fewbit.solver.objective.Objective`.

    Per cell: Gauss-Legendre with ``GL_NODES`` nodes for ``int f'^2 w`` (and for
    ``int f' w`` with a smooth weight); ``w * (f(b) - f(a))`` exactly for piecewise-constant weights.
    """
    return objective.prefix(np.asarray(t, dtype=np.float64))
