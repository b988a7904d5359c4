"""Largest-buffers diagnostic: the biggest arrays an optimized HLO module's instructions produce.

`largest_buffers(compiled.as_text(), n)` parses the text of a compiled (per-device) program and
lists its `n` largest array shapes with the instruction that makes them; the memory plan
(`sharding.plan --top-buffers N`) prints them to show where the temporaries go. A diagnostic,
not a liveness analysis.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re


@dataclasses.dataclass(frozen=True)
class BufferRow:
    """One array shape produced by an unfused instruction of the compiled per-device program."""

    bytes: int
    dtype: str
    shape: tuple[int, ...]
    count: int
    opcode: str
    op_name: str


_HLO_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_HLO_INSTR = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(")
_HLO_CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_HLO_OP_NAME = re.compile(r'op_name="([^"]*)"')
_HLO_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_HLO_ITEMSIZE |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_HLO_NOT_A_BUFFER = frozenset({"parameter", "get-tuple-element", "bitcast", "tuple", "constant"})


def largest_buffers(hlo_text: str, n: int) -> tuple[BufferRow, ...]:
    """The `n` largest array shapes that unfused instructions of an optimized HLO module produce.

    A diagnostic for where temporaries go (e.g. the [B, K, G, T, S] attention scores), not a
    liveness analysis: shapes are per device, instructions inside fusions and reducers are
    skipped, and each (dtype, shape) is listed once with its number of producers.
    """
    inner = set(_HLO_CALLS.findall(hlo_text))
    rows: dict[tuple[str, tuple[int, ...]], BufferRow] = collections.OrderedDict()
    computation = None
    for line in hlo_text.splitlines():
        header = _HLO_HEADER.match(line)
        if header:
            computation = header.group(1)
            continue
        if computation is None or computation in inner:
            continue
        m = _HLO_INSTR.match(line)
        if not m or m.group(3) in _HLO_NOT_A_BUFFER:
            continue
        itemsize = _HLO_ITEMSIZE.get(m.group(1))
        if itemsize is None:
            continue
        shape = tuple(int(d) for d in m.group(2).split(",") if d)
        key = (m.group(1), shape)
        if key in rows:
            rows[key] = dataclasses.replace(rows[key], count=rows[key].count + 1)
        else:
            op_name = _HLO_OP_NAME.search(line)
            rows[key] = BufferRow(
                bytes=math.prod(shape) * itemsize,
                dtype=m.group(1),
                shape=shape,
                count=1,
                opcode=m.group(3),
                op_name=op_name.group(1) if op_name else "",
            )
    return tuple(sorted(rows.values(), key=lambda r: -r.bytes)[:n])
