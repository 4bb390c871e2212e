"""Length-prefixed msgpack frames over a child process's pipes (an 8-byte big-endian length, then the
msgpack body): how the run's process talks to its shard workers (scenarios/parallel.py) and to its plot
process (scenarios/plot_process.py), and the command that starts such a child. Plain data only; nothing is
pickled."""

from __future__ import annotations

import struct
import sys
from typing import Any, BinaryIO

import msgpack

__all__ = ["child_command", "read_frame", "write_frame"]

_LEN = struct.Struct(">Q")


def child_command(module: str) -> list[str]:
    """The command running ``module`` as ``__main__`` in a child that ignores SIGINT from its first instruction.
    Ctrl-C reaches the whole process group; the run's process ends its children (an exit command, the end of
    their input, or a kill), and a child of its own printed a KeyboardInterrupt traceback each, also one
    still importing when the interrupt came."""
    code = ("import runpy, signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code]


def write_frame(stream: BinaryIO, obj: Any) -> None:
    """Send ``obj`` as one frame and flush."""
    data = msgpack.packb(obj, use_bin_type=True)
    stream.write(_LEN.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_frame(stream: BinaryIO) -> Any:
    """The next frame's object; EOFError when the other end has closed the pipe (before or within a frame)."""
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the other end closed the pipe")
    (n,) = _LEN.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the other end closed the pipe mid-frame")
    return msgpack.unpackb(data, raw=False)
