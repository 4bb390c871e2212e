"""Run-directory pictures drawn by a process of their own, while the run's process writes its tables.

matplotlib holds Python's GIL while it draws, so in the run's process the two pictures of a large run
(estimates.png, spend.png: about a second) wait for, and slow down, the table writer and the digests.
``ldpsim run`` therefore starts a :class:`PlotProcess` when the run begins: the child imports matplotlib
(scenarios/plots.py) while the run imports and simulates, in a thread of the lowest CPU priority (on Linux),
so that it takes only the cores the run leaves idle; then it draws each picture it is sent with the very
function and arguments the run's process would have called, writing it atomically (``plots.save``: a
temporary name, then a rename). Requests and replies are length-prefixed msgpack frames over the child's stdin and stdout,
numpy arrays as (dtype, shape, bytes); nothing is pickled.

If the child cannot be started, or dies, the pictures it has not drawn are drawn in the run's process
instead; a picture whose drawing raises is an error either way, as it is in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np

from scenarios.pipes import child_command, read_frame, write_frame

__all__ = ["PlotError", "PlotProcess", "start"]

_ARRAY = "__ndarray__"


class PlotError(RuntimeError):
    """Drawing a picture failed (in the child: its message carries the child's traceback's last line)."""


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        if a.dtype.hasobject:
            return [_encode(v) for v in a.tolist()]
        return {_ARRAY: [a.dtype.str, list(a.shape), a.tobytes()]}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if _ARRAY in obj and len(obj) == 1:
            dtype, shape, data = obj[_ARRAY]
            return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj




def _draw(name: str, path: Path, args: list[Any]) -> None:
    from scenarios import plots

    getattr(plots, name)(path, *args)


class PlotProcess:
    """The parent's side: :meth:`draw` sends a picture to draw and returns at once; :meth:`finish` waits for
    every picture sent and returns the seconds each took; :meth:`close` ends the child."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc: subprocess.Popen | None = None
        try:
            self.proc = subprocess.Popen(child_command("scenarios.plot_process"), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=env)
        except OSError:
            self.proc = None  # every picture is drawn in this process
        self._pending: list[tuple[str, Path, list[Any]]] = []  # sent, not answered yet, in order

    def draw(self, name: str, path: Path, *args: Any) -> None:
        """Draw ``plots.<name>(path, *args)`` in the child (in this process if the child is gone)."""
        request = (name, Path(path), list(args))
        if self.proc is not None:
            try:
                write_frame(self.proc.stdin, {"plot": name, "path": str(path), "args": _encode(list(args))})  # type: ignore[arg-type]
                self._pending.append(request)
                return
            except (OSError, ValueError):
                self._lost()
        _draw(*request)

    def finish(self, seconds: dict[str, float] | None = None) -> dict[str, float]:
        """Wait for every picture sent; ``seconds[file name]`` = the seconds its drawing took. Raises
        :class:`PlotError` if one failed to draw."""
        seconds = {} if seconds is None else seconds
        while self._pending:
            name, path, args = self._pending[0]
            reply = self._reply()
            if reply is None:
                for name, path, args in self._pending:  # the child is gone: draw the rest here
                    t = time.perf_counter()
                    _draw(name, path, args)
                    seconds[path.name] = round(time.perf_counter() - t, 4)
                self._pending = []
                break
            self._pending.pop(0)
            if "error" in reply:
                raise PlotError(f"{path.name}: drawing it failed: {reply['error']}")
            seconds[path.name] = round(float(reply["seconds"]), 4)
        return seconds

    def _reply(self) -> Any:
        """The child's next reply, or None when it is gone (it died, or a later request found its pipe broken
        and this process forgot it while earlier requests were still pending)."""
        if self.proc is None:
            return None
        try:
            return read_frame(self.proc.stdout)  # type: ignore[arg-type]
        except (EOFError, OSError, ValueError):
            self._lost()
            return None

    def _lost(self) -> None:
        """The child died or its pipe broke: forget it (its pending pictures are drawn here)."""
        if self.proc is not None:
            try:
                self.proc.kill()
            except OSError:
                pass
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()  # type: ignore[union-attr]
                except OSError:
                    pass
        self.proc = None

    def close(self) -> None:
        """End the child (it exits at the end of its input) and wait for it; idempotent."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()  # type: ignore[union-attr]
        self.proc = None

    def __enter__(self) -> "PlotProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start() -> PlotProcess:
    """A plot process, started now so that it has imported matplotlib by the time the pictures are drawn."""
    return PlotProcess()


def _import_quietly() -> None:
    """Import matplotlib (scenarios/plots.py) in a thread of the lowest CPU priority, so that it takes only the
    cores the run leaves idle. Linux only, where a nice value belongs to a thread: the thread drawing later
    keeps the process's own."""
    import threading

    def low() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        try:
            from scenarios import plots  # noqa: F401
        except Exception:  # noqa: BLE001 - the drawing thread imports it again and reports the error
            pass

    if sys.platform.startswith("linux"):
        thread = threading.Thread(target=low, name="ldpsim-import-matplotlib", daemon=True)
        thread.start()
        thread.join()


def serve(stdin: BinaryIO, stdout: BinaryIO, draw: Callable[[str, Path, list[Any]], None] = _draw) -> int:
    """The child's loop: import matplotlib, then draw each request and reply with its seconds or its error,
    until the end of input."""
    _import_quietly()
    from scenarios import plots  # noqa: F401  (matplotlib, imported while the run simulates)

    while True:
        try:
            request = read_frame(stdin)
        except EOFError:
            return 0
        t = time.perf_counter()
        try:
            draw(str(request["plot"]), Path(request["path"]), _decode(request["args"]))
            reply: dict[str, Any] = {"seconds": time.perf_counter() - t}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            last = traceback.format_exc().strip().splitlines()[-1]
            reply = {"error": f"{type(exc).__name__}: {exc}"[:500] or last}
        write_frame(stdout, reply)


if __name__ == "__main__":  # started by PlotProcess (pipes.child_command: SIGINT ignored)
    _frames = os.fdopen(os.dup(1), "wb")  # replies go to the original stdout; anything printed, to stderr
    os.dup2(2, 1)
    _code = serve(sys.stdin.buffer, _frames)
    _frames.flush()
    os._exit(_code)  # every reply is out: skip the interpreter's (matplotlib's) teardown, a fifth of a second
