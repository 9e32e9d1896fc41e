"""The split heuristic of forward_kvcache (decode/engine.py choose_splits), on an H200's
132 multiprocessors with two resident blocks each (the tensor-core kernel at d128)."""
import math

import pytest

from numba_flash.backends.numba.decode.engine import (MIN_KEYS_PER_SPLIT, WAVE_SHARE,
                                                      choose_splits)

SMS, RESIDENT = 132, 2


def _share(blocks, splits):
    waves = blocks * splits / (SMS * RESIDENT)
    return waves / math.ceil(waves)


@pytest.mark.parametrize("blocks, keys, want", [
    (512, 32768, 1),  # batch 16 x 32 heads: two waves' worth already
    (128, 32768, 2),  # batch 16 x 8 key/value heads: 256 of 264 slots
    (8, 32768, 29),  # batch 1 x 8 key/value heads: the fewest with 85 % of a full wave
    (16, 300, 2),  # a short cache: each split keeps MIN_KEYS_PER_SPLIT keys
])
def test_splits_fill_the_last_wave(blocks, keys, want):
    got = choose_splits(blocks, keys, SMS, RESIDENT)
    assert got == want
    most = max(1, keys // MIN_KEYS_PER_SPLIT)
    assert got <= most
    best = max(_share(blocks, n) for n in range(1, min(128, most) + 1))
    assert got == 1 or _share(blocks, got) >= WAVE_SHARE * best
