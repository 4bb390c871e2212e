"""One line for an exception raised by a user's own code: a plugin protocol's device or collector side, its
reference model, a behavior or any other module outside ldpsim and the libraries it runs on. The ``ldpsim``
command prints where it was raised and what, instead of a traceback through ldpsim's internals; an exception
raised in ldpsim itself is a bug and keeps its traceback. ``LDPSIM_TRACEBACK=1`` keeps every traceback."""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import traceback
from pathlib import Path

#: ldpsim's own packages
OWN = tuple(str(Path(__file__).resolve().parent.parent / p) + os.sep
            for p in ("protocols", "agents", "collector", "scenarios"))
#: the libraries ldpsim runs user code through (their frames are not the user's)
LIBRARIES = ("numpy", "numba", "llvmlite", "simpy", "msgpack", "pyarrow", "structlog", "ray", "distributed",
             "matplotlib", "tqdm", "scipy", "pandas", "dp_accounting")
#: the note the runner adds to an exception raised during a simulated run
ROUND_NOTE = "ldpsim: during round "


def _not_users() -> tuple[str, ...]:
    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
    for name in LIBRARIES:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            dirs.add(str(Path(file).resolve().parent))
    return OWN + tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def _users(filename: str, skip: tuple[str, ...]) -> bool:
    """Whether a traceback's file is a user's: a real file outside ldpsim and the libraries (``skip``)."""
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(skip)


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame in a user's code of ``exc``'s traceback or of the exceptions it was raised from
    (SimPy re-raises a process's exception from a copy), the deepest first; None: raised in ldpsim or a
    library."""
    skip = _not_users()
    chain: list[BaseException] = []
    while exc is not None and len(chain) < 20:
        chain.append(exc)
        exc = exc.__cause__  # type: ignore[assignment]
    for link in reversed(chain):
        frames = [f for f in traceback.extract_tb(link.__traceback__) if _users(f.filename, skip)]
        if frames:
            return frames[-1]
    return None


_FILE_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$', re.M)


def describe_text(traceback_text: str, exc: BaseException) -> str | None:
    """:func:`describe` from a traceback as text (a Ray actor's, whose frames do not travel): its innermost
    ``File ..., line ..., in ...`` in a user's code, with ``exc``'s type and message."""
    skip = _not_users()
    found = [m for m in _FILE_LINE.finditer(traceback_text) if _users(m["file"], skip)]
    if not found:
        return None
    m = found[-1]
    return _where(m["file"], int(m["line"]), m["name"].strip(), exc)


def _where(filename: str, lineno: int | None, name: str, exc: BaseException) -> str:
    try:
        shown = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        shown = filename
    if shown.startswith(".." + os.sep + ".."):
        shown = filename
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{shown}:{lineno}, in {name}: {type(exc).__name__}{': ' + message if message else ''}"


def describe(exc: BaseException) -> str | None:
    """``file:line, in function: Type: message`` for an exception a user's code raised (or, for an error a
    worker process or Ray actor passed on, what it described there: ``user_line``), None for one raised in
    ldpsim or a library."""
    link: BaseException | None = exc
    while link is not None:
        given = getattr(link, "user_line", None)
        if isinstance(given, str):
            return given
        link = link.__cause__
    frame = user_frame(exc)
    return None if frame is None else _where(frame.filename, frame.lineno, frame.name, exc)


def one_line(exc: BaseException) -> str | None:
    """:func:`describe`, with the round it was raised in when the runner noted it, and how to see the
    traceback; None for an exception raised in ldpsim or a library, or when LDPSIM_TRACEBACK is set."""
    if os.environ.get("LDPSIM_TRACEBACK"):
        return None
    what = describe(exc)
    if what is None:
        return None
    rounds = [n[len("ldpsim: "):] for n in getattr(exc, "__notes__", ()) if n.startswith(ROUND_NOTE)]
    return f"{what} ({rounds[0] + '; ' if rounds else ''}LDPSIM_TRACEBACK=1 shows the traceback)"
