"""Hand-written TensorBoard event files, read back by TensorBoard's own (independent) readers."""

import os
import re
import socket

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_masked_crc
from tensorboard.util import tensor_util

from bapo_jax.train.tensorboard import (
    EventFileWriter,
    crc32c,
    encode_event,
    frame_record,
    iter_records,
    masked_crc32c,
)


def _scalars(logdir, tag):
    """(step, value) pairs of `tag` as the legacy EventAccumulator (purging restarts) sees them."""
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)], acc.Tags()["scalars"]


def _plugin_scalars(logdir, tag):
    """The same through plugin_event_accumulator (tensorboard --load_fast=false)."""
    acc = plugin_event_accumulator.EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def _f32(values):
    return [float(np.float32(v)) for v in values]


def test_crc32c_known_vectors_and_tensorboard_mask():
    # RFC 3720 / iSCSI check value of CRC-32C.
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA
    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 8, 100, 1000):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert masked_crc32c(data) == tb_masked_crc(data)


def test_scalars_read_back_by_event_accumulator(tmp_path):
    writer = EventFileWriter(tmp_path, start_step=0, clock=lambda: 1000.0)
    rewards = [0.25, -1.5, 3.0e-3, 7.0]
    for step, reward in enumerate(rewards):
        writer.add_scalars(step, {"reward/mean": reward, "c_high": 1.2 + 0.05 * step, "n": step})
    writer.close()

    pattern = rf"events\.out\.tfevents\.\d{{10}}\.{re.escape(socket.gethostname())}\.{os.getpid()}"
    assert re.fullmatch(pattern, writer.path.name)
    points, tags = _scalars(tmp_path, "reward/mean")
    assert sorted(tags) == ["c_high", "n", "reward/mean"]
    assert points == list(zip(range(4), _f32(rewards), strict=True))
    c_high, _ = _scalars(tmp_path, "c_high")
    np.testing.assert_array_equal([v for _, v in c_high], _f32([1.2, 1.25, 1.3, 1.35]))
    assert _plugin_scalars(tmp_path, "n") == [(s, float(s)) for s in range(4)]


def test_records_are_framed_with_valid_crcs(tmp_path):
    writer = EventFileWriter(tmp_path, start_step=5, clock=lambda: 1234.5)
    writer.add_scalars(5, {"rho": 0.4}, wall_time=2000.0)
    writer.add_scalars(9, {"rho": 0.5, "big": 1e39})
    writer.close()

    events = [event_pb2.Event.FromString(data) for data in iter_records(writer.path)]
    assert [e.WhichOneof("what") for e in events] == [
        "file_version", "session_log", "summary", "summary",
    ]  # fmt: skip
    assert events[0].file_version == "brain.Event:2"
    assert events[0].wall_time == 1234.5
    assert events[1].session_log.status == event_pb2.SessionLog.START
    assert events[1].step == 5
    assert (events[2].step, events[2].wall_time) == (5, 2000.0)
    assert [(v.tag, v.simple_value) for v in events[2].summary.value] == [("rho", np.float32(0.4))]
    big = {v.tag: v.simple_value for v in events[3].summary.value}["big"]
    assert events[3].step == 9 and big == np.inf  # beyond float32 range

    blob = bytearray(writer.path.read_bytes())
    # A torn last record (killed mid-write) ends the stream at the last complete record.
    torn = tmp_path / "torn"
    torn.write_bytes(bytes(blob) + frame_record(b"x" * 40)[:30])
    assert len(list(iter_records(torn))) == 4
    blob[-3] ^= 0xFF  # flip a byte of the last data CRC
    corrupt = tmp_path / "corrupt"
    corrupt.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="data CRC mismatch"):
        list(iter_records(corrupt))


def test_event_encoding_matches_protobuf_for_edge_values():
    for step in (0, 1, 127, 128, 2**40, -1):
        event = event_pb2.Event.FromString(encode_event(0.5, step, scalars={"é/x": -0.0}))
        assert event.step == step
        assert event.summary.value[0].tag == "é/x"
    with pytest.raises(ValueError, match="exactly one"):
        encode_event(0.0, 0, file_version="v", session_start=True)


def test_restart_purges_orphaned_steps(tmp_path):
    """Killed after step 5, resumed from a checkpoint after step 2: 0..2 old, 3..7 new."""
    clock = lambda: 1_700_000_000.0  # both files in the same second: names must still order
    first = EventFileWriter(tmp_path, start_step=0, clock=clock)
    for step in range(6):
        first.add_scalars(step, {"reward": 100.0 + step, "only_old": 1.0})
    first.close()
    with open(first.path, "ab") as f:  # a record torn by the kill
        f.write(frame_record(encode_event(1.0, 6, scalars={"reward": 106.0}))[:20])

    second = EventFileWriter(tmp_path, start_step=3, clock=clock)
    for step in range(3, 8):
        second.add_scalars(step, {"reward": 200.0 + step})
    second.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.path.name, second.path.name]

    expected = [(s, 100.0 + s) for s in range(3)] + [(s, 200.0 + s) for s in range(3, 8)]
    points, _ = _scalars(tmp_path, "reward")
    assert points == expected
    assert _plugin_scalars(tmp_path, "reward") == expected
    # START purges every tag, including one the restarted run never writes again.
    only_old, _ = _scalars(tmp_path, "only_old")
    assert [s for s, _ in only_old] == [0, 1, 2]


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="start_step must be an int >= 0, got -1"):
        EventFileWriter(tmp_path, start_step=-1)
    writer = EventFileWriter(tmp_path, start_step=2)
    with pytest.raises(ValueError, match="step must be an int > 1, got 1"):
        writer.add_scalars(1, {"a": 1.0})
    writer.add_scalars(2, {"a": 1.0})
    with pytest.raises(ValueError, match="step must be an int > 2, got 2"):
        writer.add_scalars(2, {"a": 1.0})
    with pytest.raises(ValueError, match="scalar 'a' must be a real number"):
        writer.add_scalars(3, {"a": "x"})
    writer.close()
    with pytest.raises(RuntimeError, match="is closed"):
        writer.add_scalars(4, {"a": 1.0})
