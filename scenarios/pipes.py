"""Length-prefixed msgpack frames over a child process's pipes (an 8-byte big-endian length, then the
msgpack body): how the run's process talks to its shard workers (scenarios/parallel.py) and to its plot
process (scenarios/plot_process.py). Plain data only; nothing is pickled."""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

import msgpack

__all__ = ["read_frame", "write_frame"]

_LEN = struct.Struct(">Q")


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
