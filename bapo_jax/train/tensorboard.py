"""TensorBoard scalar event files, written by hand (no TensorFlow, no protobuf runtime).

An event file is a sequence of TFRecords:

    record = len:uint64le | masked_crc(len bytes):uint32le | data | masked_crc(data):uint32le
    masked_crc(x) = rotate_right(crc32c(x), 15) + 0xA282EAD8   (mod 2**32)

where crc32c is CRC-32C (Castagnoli, reflected polynomial 0x82F63B78). Each `data` is one
serialised `tensorboard.Event` protobuf; the fields used here (proto field number, wire type):

    Event      { double wall_time = 1 (64-bit); int64 step = 2 (varint); oneof {
                 string file_version = 3; Summary summary = 5; SessionLog session_log = 7 } }
    Summary    { repeated Value value = 1 }
    Value      { string tag = 1; float simple_value = 2 (32-bit) }
    SessionLog { SessionStatus status = 1 (varint, START = 1); string msg = 3 }

Every file starts with Event{file_version: "brain.Event:2"}, then Event{session_log: START}
at `start_step`, then one Event per logged step holding all of that step's scalars.

Restarts. A run resumed from a checkpoint taken after step s re-logs steps s+1, s+2, ...
into a NEW file (the name carries a later timestamp so readers, which read a run's files in
lexicographic order, read it last). TensorBoard drops the stale steps of the killed run:
- Python loaders (`EventAccumulator`, and `plugin_event_accumulator` behind
  `tensorboard --load_fast=false`): with file_version >= 2 a SessionLog START at step k purges
  every earlier-read event with step >= k. `plugin_event_accumulator` ignores the FIRST START
  of a run (it marks a start, not a restart), so every file, fresh runs included, carries one;
  the resumed file's START at s+1 is then the second and purges steps > s.
- The Rust data server (default `--load_fast`) preempts per tag instead: a value at step k
  drops the tag's stored values at steps >= k. Stale steps of a tag the restarted run never
  logs again stay visible there.
A fresh run (start_step 0) in a directory with old files purges everything older.
"""

from __future__ import annotations

import math
import os
import re
import socket
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

__all__ = [
    "EventFileWriter",
    "crc32c",
    "encode_event",
    "frame_record",
    "iter_records",
    "masked_crc32c",
]

FILE_VERSION = "brain.Event:2"
FILE_PREFIX = "events.out.tfevents."
SESSION_START = 1
_FILE_TIME = re.compile(r"^events\.out\.tfevents\.(\d+)\.")


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`; crc32c(b"123456789") == 0xE3069283."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate_right(crc32c, 15) + 0xA282EAD8, mod 2**32."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame_record(data: bytes) -> bytes:
    """One TFRecord: length, masked CRC of the length, data, masked CRC of the data."""
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def iter_records(path: str | os.PathLike) -> Iterator[bytes]:
    """Yields the data of each TFRecord in `path`, checking both CRCs.

    A truncated last record (writer killed mid-write) ends the iteration silently, as in
    TensorBoard's readers; a CRC mismatch raises ValueError naming the byte offset.
    """
    blob = Path(path).read_bytes()
    offset = 0
    while offset + 12 <= len(blob):
        header = blob[offset : offset + 8]
        (length_crc,) = struct.unpack("<I", blob[offset + 8 : offset + 12])
        if masked_crc32c(header) != length_crc:
            raise ValueError(f"{path}: length CRC mismatch in the record at byte {offset}")
        (length,) = struct.unpack("<Q", header)
        end = offset + 12 + length + 4
        if end > len(blob):
            return
        data = blob[offset + 12 : end - 4]
        (data_crc,) = struct.unpack("<I", blob[end - 4 : end])
        if masked_crc32c(data) != data_crc:
            raise ValueError(f"{path}: data CRC mismatch in the record at byte {offset}")
        yield data
        offset = end


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 -> two's complement, 10 bytes
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
    with np.errstate(over="ignore"):  # finite doubles beyond float32 range become +-inf
        return np.float32(value).astype("<f4").tobytes()


def encode_event(
    wall_time: float,
    step: int,
    *,
    file_version: str | None = None,
    scalars: Mapping[str, float] | None = None,
    session_start: bool = False,
) -> bytes:
    """Serialises one Event with exactly one of file_version / scalars / session_start."""
    if sum([file_version is not None, scalars is not None, session_start]) != 1:
        raise ValueError("encode_event takes exactly one of file_version, scalars, session_start")
    out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step)
    if file_version is not None:
        return out + _length_delimited(3, file_version.encode())
    if session_start:
        return out + _length_delimited(7, _key(1, 0) + _varint(SESSION_START))
    values = b"".join(
        _length_delimited(1, _length_delimited(1, tag.encode()) + _key(2, 5) + _float32(value))
        for tag, value in scalars.items()
    )
    return out + _length_delimited(5, values)


def _next_file_time(logdir: Path, now: float) -> int:
    """Seconds for the new file name: now, or 1 + the newest existing file's time if later."""
    existing = [int(m.group(1)) for p in logdir.iterdir() if (m := _FILE_TIME.match(p.name))]
    return max([int(now), *(t + 1 for t in existing)])


class EventFileWriter:
    """Appends scalar events to a new `events.out.tfevents.<time>.<host>.<pid>` in `logdir`.

    Each `add_scalars` call is one Event (one step, many tags), flushed to the OS at once so
    a killed process loses at most the record being written.
    """

    def __init__(
        self,
        logdir: str | os.PathLike,
        *,
        start_step: int,
        clock: Callable[[], float] = time.time,
    ):
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
        self._clock = clock
        self._last_step = start_step - 1
        logdir = Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        now = clock()
        name = f"{FILE_PREFIX}{_next_file_time(logdir, now):010d}.{socket.gethostname()}"
        self.path = logdir / f"{name}.{os.getpid()}"
        self._file = open(self.path, "xb")  # noqa: SIM115 - owned until close()
        self._write(encode_event(now, start_step, file_version=FILE_VERSION))
        self._write(encode_event(now, start_step, session_start=True))
        self._file.flush()

    def _write(self, event: bytes) -> None:
        self._file.write(frame_record(event))

    def add_scalars(
        self, step: int, scalars: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        """Writes one Event at `step` with a simple_value per tag (values stored as float32)."""
        if self._file is None:
            raise RuntimeError(f"{self.path} is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step <= self._last_step:
            raise ValueError(f"step must be an int > {self._last_step}, got {step!r}")
        for tag, value in scalars.items():
            if not isinstance(tag, str) or not tag:
                raise ValueError(f"scalar tags must be non-empty strings, got {tag!r}")
            if not isinstance(value, int | float):
                raise ValueError(f"scalar {tag!r} must be a real number, got {value!r}")
        self._last_step = step
        wall_time = self._clock() if wall_time is None else wall_time
        if not math.isfinite(wall_time):
            raise ValueError(f"wall_time must be finite, got {wall_time}")
        self._write(
            encode_event(wall_time, step, scalars={k: float(v) for k, v in scalars.items()})
        )
        self._file.flush()

    def close(self) -> None:
        """Flushes, fsyncs and closes the file; later calls do nothing."""
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
