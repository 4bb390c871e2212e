"""scenarios/jit.py: numba's BLAS probe skipped in the processes ldpsim owns."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import sys
import numpy as np
from scenarios import jit
skipped = jit.skip_blas_probe()
from protocols import keyed
out = np.empty(3)
keyed._normal_kernel(np.uint64(5), np.arange(3), out)  # a cached kernel loads (numba's target set up)
import numba.np.arraymath as am, numba.np.linalg as la
print(skipped, am._HAVE_BLAS, "scipy.linalg" in sys.modules, am.ensure_blas is la.ensure_blas,
      la.ensure_blas.__module__, jit.skip_blas_probe())
"""


def test_the_kernels_load_without_importing_scipy_linalg() -> None:
    """In a fresh process, skip_blas_probe makes numba's set-up leave scipy.linalg unimported; numba's own
    probe is back in place for anything compiled later, and a second call does nothing."""
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False", "True", "numba.np.linalg", "False"]


def test_ldpsim_blas_probe_1_keeps_numba_s_own_probe() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "LDPSIM_BLAS_PROBE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:3] == ["False", "True", "True"]
