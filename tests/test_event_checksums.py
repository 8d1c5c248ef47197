"""The trainers' TensorBoard records carry the checksums TensorBoard's own code computes, from a C
implementation (run.masked_crc32c) instead of its pure-Python loop."""

import os
import struct

import numpy as np
import pytest
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards
from tensorboard.summary.writer import record_writer

import run


@pytest.mark.parametrize("size", [0, 1, 3, 8, 255, 4096, 100_003])
def test_masked_crc32c_is_tensorboards(size):
    data = os.urandom(size)
    assert run.masked_crc32c(data) == tensorboards(data)
    assert run.masked_crc32c(memoryview(data)) == tensorboards(data)


def test_event_files_hold_valid_records(tmp_path):
    """An image and a scalar written through torch's SummaryWriter: every record of the event file
    (length, its checksum, data, its checksum) checks out against TensorBoard's own checksum."""
    from torch.utils.tensorboard import SummaryWriter

    assert record_writer.masked_crc32c is run.masked_crc32c
    writer = SummaryWriter(tmp_path)
    writer.add_image("eval/images", np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8),
                     1, dataformats="HWC")
    writer.add_scalar("eval/reward_mean", 0.5, 1)
    writer.close()
    (events,) = tmp_path.glob("events.out.tfevents.*")
    raw = events.read_bytes()
    records = 0
    position = 0
    while position < len(raw):
        header = raw[position : position + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", raw[position + 8 : position + 12])[0] == tensorboards(header)
        data = raw[position + 12 : position + 12 + length]
        footer = raw[position + 12 + length : position + 16 + length]
        assert struct.unpack("<I", footer)[0] == tensorboards(data)
        position += 16 + length
        records += 1
    assert records == 3  # the file version, the image, the scalar
