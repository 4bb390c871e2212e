"""numba's start-up in an ``ldpsim`` process: its BLAS probe skipped, so that loading the kernels does not
import SciPy's linear algebra.

The first compiled kernel a process calls (even one loaded from the disk cache) makes numba set up its CPU
target, which imports ``numba.np.arraymath``; that module asks once, at import, whether SciPy's BLAS is there
(``_HAVE_BLAS``, by importing ``scipy.linalg.cython_blas``). Importing ``scipy.linalg`` takes 0.15-0.2 s here (it
imports ``numpy.f2py`` and SciPy's array-API layer), and nothing else in a run imports it. In a run that first
call happens inside the simulation (the first day's levels, the device sides' ids), where the probe took about
a sixteenth of a 3M-device simulation's time (``benchmarks/HISTORY.md``). The answer is used by one
thing only: whether ``np.correlate`` and ``np.convolve`` inside a compiled function call BLAS's dot or numba's
own loop for their inner products. No kernel of ldpsim calls either; numba's linear algebra (``np.dot``,
``np.linalg``) checks for SciPy itself when a function using it is compiled, as before.

:func:`skip_blas_probe` imports ``numba.np.arraymath`` with the probe answering "no BLAS" at once. Like
:mod:`scenarios.allocator`, it is called by the processes ``ldpsim`` owns (the program, its worker processes),
never on import: a library does not change its host's numba. It does nothing where ``numba.np.arraymath`` is
already imported, where numba's internals are not the ones it knows, or where ``LDPSIM_BLAS_PROBE=1`` asks for
numba's own probe.
"""

from __future__ import annotations

import os
import sys

__all__ = ["skip_blas_probe"]


def skip_blas_probe() -> bool:
    """Import ``numba.np.arraymath`` without its probe for SciPy's BLAS (module docstring); whether it did."""
    if "numba.np.arraymath" in sys.modules or os.environ.get("LDPSIM_BLAS_PROBE", "") == "1":
        return False
    try:
        import numba.np.linalg as linalg
    except ImportError:
        return False
    probe = getattr(linalg, "ensure_blas", None)
    if probe is None:
        return False

    def no_blas() -> None:
        raise ImportError("ldpsim: numba's BLAS probe skipped (scenarios/jit.py)")

    linalg.ensure_blas = no_blas
    try:
        import numba.np.arraymath as arraymath
    finally:
        linalg.ensure_blas = probe
    if getattr(arraymath, "ensure_blas", None) is no_blas:  # its own reference, for anything that asks later
        arraymath.ensure_blas = probe
    return getattr(arraymath, "_HAVE_BLAS", None) is False
