"""The decode launcher's choices that need no GPU: the split count."""

import pytest

from ptxattn.decode import MAX_SPLITS, choose_splits


@pytest.mark.parametrize("tiles, key_blocks, sms, expected", [
    (512, 128, 264, 1),   # batch 64 x 8 kv heads fill the GPU: no split
    (64, 512, 264, 4),    # batch 8 x 8 kv heads: 256 blocks in one wave of 2 x 132 slots
    (1, 1, 132, 1),       # one key block cannot split
    (1, 3, 132, 3),       # no split without a key block of its own
])
def test_split_count(tiles, key_blocks, sms, expected):
    assert choose_splits(tiles, key_blocks, sms) == expected


def test_splits_fill_the_gpu_in_nearly_whole_waves():
    for tiles in range(1, 106):
        splits = choose_splits(tiles, 10_000, 132)
        waves = tiles * splits / 132
        assert 1 <= splits <= MAX_SPLITS
        assert waves / -(-waves // 1) >= 0.8, (tiles, splits)
