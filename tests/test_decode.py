"""The decode launcher's choices that need no GPU: the split count."""

import pytest

from ptxattn.launchers.split_kv import MAX_SPLITS, choose_splits, splits_one_wave


@pytest.mark.parametrize("tiles, key_blocks, sms, expected", [
    (512, 128, 264, 1),   # batch 64 x 8 kv heads fill the GPU: no split
    (64, 512, 264, 4),    # paged, batch 8 x 8 kv heads: 256 blocks in one wave of 2 x 132
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


@pytest.mark.parametrize("tiles, key_blocks, sms, expected", [
    (64, 512, 132, 2),     # batch 8 x 8 kv heads: 128 blocks, one on each of 132 SMs
    (8, 2048, 132, 16),    # batch 1 x 8 kv heads: 128 blocks
    (66, 128, 132, 2),     # the most tiles it is asked about: half the SMs
    (8, 4, 132, 4),        # no split without a key block of its own
    (1, 10_000, 132, MAX_SPLITS),
])
def test_one_wave_split_count(tiles, key_blocks, sms, expected):
    assert splits_one_wave(tiles, key_blocks, sms) == expected
