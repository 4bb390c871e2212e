"""Length-prefixed frames for the live runtime (sans-IO): a 4-byte big-endian length, then a wire message.

:class:`FrameDecoder` takes bytes as they arrive and returns whole frames; a length above the limit is a
:class:`~protocols.wire.WireError` before any of the body is buffered (docs/design.md section 5: bounded sizes).
"""

from __future__ import annotations

import struct

from protocols.wire import MAX_MESSAGE_BYTES, WireError

_LEN = struct.Struct(">I")


def frame(payload: bytes) -> bytes:
    """One frame: length prefix + payload."""
    return _LEN.pack(len(payload)) + payload


class FrameTooLarge(WireError):
    """A frame header announcing more bytes than the limit (raised before any of the body is buffered)."""


class FrameDecoder:
    def __init__(self, max_frame: int = MAX_MESSAGE_BYTES) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held (a client that stalls mid-frame leaves this above 0)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > self.max_frame:
                raise FrameTooLarge(f"frame of {n} bytes exceeds the limit of {self.max_frame}")
            if len(self._buf) < _LEN.size + n:
                break
            out.append(bytes(self._buf[_LEN.size:_LEN.size + n]))
            del self._buf[:_LEN.size + n]
        return out
