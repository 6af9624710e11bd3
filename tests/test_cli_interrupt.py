"""Ctrl-C during ``fewbit fit``: a clean ``Aborted!``, never a crash, no file written.

The signal is sent while the numba DP (solver/dp.py, a parallel kernel) runs: the
process must exit with status 130 (128 + SIGINT), print ``Aborted!`` as its last
stderr line, show no traceback, and leave neither the output file nor a temporary file.
(It used to die with SIGSEGV: the kernel re-entered the interpreter to box its result
arrays, which ran the pending SIGINT handler inside numba's boxing code.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

# Progress frames "n/total"; the DP starts after the first step (prefix integrals).
_FRAME = re.compile(rb"\| *(\d+)/(\d+) ")


def _warm_numba_cache() -> None:
    """Compile (and cache on disk) the DP kernel here, so that the child process does not
    spend the test's time compiling it."""
    from fewbit.solver.dp import dp_numba_tables

    x = np.linspace(0.0, 1.0, 40)
    dp_numba_tables(x, x * x, x**3, 4)


def _read_available(stream) -> bytes:
    try:
        return stream.read() or b""
    except BlockingIOError:
        return b""


def _interrupt_fit(tmp_path, grid: int, timeout: float = 120.0):
    out = tmp_path / "big.json"
    cmd = [sys.executable, "-m", "fewbit.cli", "fit", "gelu", "--grid", str(grid),
           "--bits", "1", "2", "3", "4", "-o", str(out)]
    # start_new_session: the signal reaches the child only, as a terminal's Ctrl-C
    # reaches the foreground job. preexec_fn: SIGINT at its default in the child, as in a
    # terminal -- a suite started as a background job of a non-interactive shell (CI, nohup
    # ... &) inherits SIGINT ignored, Python then installs no KeyboardInterrupt handler and
    # the fit ran to the end (restore_signals restores SIGPIPE/SIGXFSZ only).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        os.set_blocking(proc.stderr.fileno(), False)
        err = b""
        deadline = time.monotonic() + timeout
        # Wait until the DP kernel runs: one of its pieces done (step 2), or 1.5 s after
        # the DP began (step 1: prefix integrals done; loading the cached kernel takes a
        # moment, and a signal then lands in Python code, which was never the problem).
        dp_began = None
        while True:
            assert proc.poll() is None, (proc.returncode, err.decode(errors="replace"))
            assert time.monotonic() < deadline, err.decode(errors="replace")
            done = max((int(n) for n, _ in _FRAME.findall(err)), default=0)
            if done >= 1 and dp_began is None:
                dp_began = time.monotonic()
            if done >= 2 or (dp_began is not None and time.monotonic() - dp_began > 1.5):
                break
            time.sleep(0.02)
            err += _read_available(proc.stderr)
        assert proc.poll() is None, "the fit finished before the signal; use a larger grid"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        os.set_blocking(proc.stderr.fileno(), True)
        stdout, rest = proc.communicate(timeout=timeout)
        return proc.returncode, stdout.decode(), (err + rest).decode(errors="replace"), time.monotonic() - sent, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_during_the_dp_aborts_cleanly(tmp_path):
    _warm_numba_cache()
    rc, stdout, stderr, _, out = _interrupt_fit(tmp_path, grid=50000)
    assert rc == 130, (rc, stderr[-3000:])  # -11 was SIGSEGV; 1 before it was 128 + SIGINT
    assert "Traceback" not in stderr and "Error" not in stderr, stderr[-3000:]
    assert stderr.replace("\r", "\n").strip().splitlines()[-1] == "Aborted!", stderr[-3000:]
    assert "wrote" not in stdout
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary file either
    # Answered within a piece of the DP, not after it: the progress bar never reached the
    # refinements (steps: prefix, the DP's pieces, then one per bit width).
    frames = [(int(n), int(t)) for n, t in _FRAME.findall(stderr.encode())]
    assert frames and max(n for n, _ in frames) < frames[-1][1] - 4, frames[-3:]
