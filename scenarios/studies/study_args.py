"""What the study scripts here share: their one command-line argument, the study's directory (--help prints the
script's docstring; a plot script needs the sweep's output in it and says so in one line when it is missing),
and the spread their tables state."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def study_dir(doc: str | None, needs: str | None = None) -> Path:
    """The directory named on the command line; with ``needs``, a file that must already be in it."""
    lines = (doc or "").strip().splitlines()
    ap = argparse.ArgumentParser(description=lines[0] if lines else None, epilog="\n".join(lines[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path, help="the study's directory" + (f" (holding {needs})" if needs else ""))
    path: Path = ap.parse_args().directory
    if needs and not (path / needs).is_file():
        ap.exit(2, f"{ap.prog}: error: {path / needs} not found: run the study's sweep into {path} first\n")
    return path


def spread(x: np.ndarray) -> str:
    """`` ± sd`` over the repetitions; nothing for one (no spread to state)."""
    return f" ± {x.std(ddof=1):.1f}" if x.size > 1 else ""


if __name__ == "__main__":
    sys.exit("a helper of the study scripts; run one of them")
