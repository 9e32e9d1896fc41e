"""The ring plan against the global mask, element by element (pure Python, no kernels): every
(query, key) pair of the sequence is seen by exactly one call of exactly one step iff the
global window lets the query see it."""
import numpy as np
import pytest

from numba_flash import ring_plan


def global_mask(seqlen, left, right):
    i = np.arange(seqlen)[:, None]
    j = np.arange(seqlen)[None, :]
    seen = np.ones((seqlen, seqlen), bool)
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    return seen


def local_mask(call):
    """What the kernel's bottom-right aligned window sees in the call's block."""
    rows, keys = call.q_end - call.q_begin, call.k_end - call.k_begin
    left, right = call.window
    i = np.arange(rows)[:, None]
    j = np.arange(keys)[None, :]
    seen = np.ones((rows, keys), bool)
    if left >= 0:
        seen &= j >= i + keys - rows - left
    if right >= 0:
        seen &= j <= i + keys - rows + right
    return seen


def positions(layout, rank, world, shard_len):
    """The global position of each row of rank's shard."""
    return np.concatenate([np.arange(s.start, s.start + s.length)
                           for s in ring_plan.segments(layout, rank, world, shard_len)])


def covered(layout, world, shard_len, left, right):
    seqlen = world * shard_len
    count = np.zeros((seqlen, seqlen), int)
    calls = 0
    for rank in range(world):
        q_pos = positions(layout, rank, world, shard_len)
        for source, step in ring_plan.ring_plan(layout, rank, world, shard_len, left, right):
            k_pos = positions(layout, source, world, shard_len)
            for call in step:
                seen = local_mask(call)
                assert seen.any(axis=1).all() and seen.any(axis=0).all(), call  # trimmed
                rows = q_pos[call.q_begin:call.q_end]
                keys = k_pos[call.k_begin:call.k_end]
                count[np.ix_(rows, keys)] += seen
                calls += 1
    return count, calls


WINDOWS = [(-1, -1), (-1, 0), (0, 0), (3, 0), (5, 2), (-1, 4), (6, -1), (1, 9), (40, 0),
           (0, -1)]


@pytest.mark.parametrize("layout", ring_plan.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("window", WINDOWS)
def test_every_pair_is_seen_once_exactly_where_the_mask_allows(layout, world, window):
    for shard_len in (2, 6, 10):
        count, _ = covered(layout, world, shard_len, *window)
        want = global_mask(world * shard_len, *window)
        assert np.array_equal(count, want.astype(int)), (shard_len, np.argwhere(count != want))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_plain_rings_make_one_call_a_step(world):
    """Without a window: causal makes one call on each step it does not skip, full attention
    one on every step; zigzag balances causal (every rank calls on every step)."""
    for layout in ring_plan.LAYOUTS:
        for rank in range(world):
            full = ring_plan.ring_plan(layout, rank, world, 8, -1, -1)
            assert [len(calls) for _, calls in full] == [1] * world
            causal = ring_plan.ring_plan(layout, rank, world, 8, -1, 0)
            assert all(len(calls) <= 1 for _, calls in causal)
            if layout == "zigzag":
                assert [len(calls) for _, calls in causal] == [1] * world
                rows = [(c[0].q_end - c[0].q_begin) * (c[0].k_end - c[0].k_begin)
                        for _, c in causal[1:]]
                assert rows == [32] * (world - 1)  # half the block: the same work each step
            else:  # the shards in the future are skipped
                assert sum(len(calls) for _, calls in causal) == rank + 1


def test_full_blocks_share_one_window():
    """Blocks the window does not cut are called unmasked (one compiled spec for all)."""
    for _, calls in ring_plan.ring_plan("contiguous", 3, 4, 8, -1, 0)[1:]:
        assert [c.window for c in calls] == [(-1, -1)]


def test_bad_layout_and_odd_zigzag_shard():
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_plan.ring_plan("striped", 0, 2, 8, -1, -1)
    with pytest.raises(ValueError, match="must be even"):
        ring_plan.ring_plan("zigzag", 0, 2, 7, -1, -1)
