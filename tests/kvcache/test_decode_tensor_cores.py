"""The tensor-core decode kernel (decode/tensor_cores.py) through numba-mma, simulated: against
float64 attention over each sequence's appended cache by the accuracy rule, as
test_forward_kvcache.py checks the SIMT kernel: GQA groups and query tokens packed into one
16-row slice, rows past the call's, warps whose pipelines wrap around their stages, pages,
new tokens, windows with softcap, ALiBi, several row tiles, Q read from shared memory above
head dim 128."""
import numpy as np
import pytest
from test_forward_kvcache import _check, _make

from numba_flash.backends.numba.decode import tensor_cores


def test_one_token_of_a_gqa_group_with_each_split(rng):
    """GQA 4: the group's four query heads are four rows of the slice (twelve rows past the
    call's); num_splits 1, 2 and the heuristic's."""
    arrays = _make(rng, "float16", 2, 1, 4, 1, 80, 1, paged=False, full_first=True)
    _check("float16", arrays, {}, backend="numba-mma", splits=(0, 1, 2))


@pytest.mark.parametrize("block_size", [0, 16, 32], ids=["contiguous", "paged16", "paged32"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_each_warp_reuses_its_stages(rng, monkeypatch, stages, block_size):
    """320 keys in one split: 20 tiles of 16 keys over 4 warps, 5 for warp 0 through its
    stages and around again, at each pipeline depth a GPU may get (4 at d64 on sm_90, 3 at
    d128, 2 where shared memory is short); paged, each tile in a page of its own or two
    tiles a page (the second from slot 16), the page a warp reads one tile ahead."""
    from numba_flash.backends.numba.decode import engine
    monkeypatch.setattr(engine, "_tensor_core_stages", lambda spec, q: stages)
    arrays = _make(rng, "float16", 1, 1, 1, 1, 320, 0, paged=bool(block_size),
                   block_size=block_size or 16, full_first=True)
    _check("float16", arrays, dict(causal=True), backend="numba-mma", splits=(1,))


@pytest.mark.parametrize("stages", [2, 4])
def test_a_cache_of_one_page(rng, monkeypatch, stages):
    """One tile for warp 0, none for warps 1-3, a block table of one column: no warp reads
    the table for a tile it does not have (the simulator's arrays raise on an index past
    their end)."""
    from numba_flash.backends.numba.decode import engine
    monkeypatch.setattr(engine, "_tensor_core_stages", lambda spec, q: stages)
    arrays = _make(rng, "float16", 2, 1, 2, 1, 16, 1, paged=True, full_first=True)
    assert arrays[-1].shape == (2, 1)
    _check("float16", arrays, dict(causal=True), backend="numba-mma", splits=(1,))


def test_the_stages_fit_two_blocks_where_they_can():
    assert tensor_cores.choose_stages(16, 1 << 20) == tensor_cores.MAX_STAGES
    assert tensor_cores.choose_stages(128, 227 * 1024) == 3  # (sm_90: two 106 KiB blocks)
    assert tensor_cores.choose_stages(64, 227 * 1024) == 4
    assert tensor_cores.choose_stages(256, 227 * 1024) == 3  # (one block)
    assert tensor_cores.choose_stages(256, 99 * 1024) is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_speculative_tokens_appended_to_a_paged_cache(rng, dtype):
    """Four new tokens of a GQA-4 group fill the 16 rows; causal; a permuted block table."""
    arrays = _make(rng, dtype, 2, 4, 4, 1, 64, 4, paged=True)
    _check(dtype, arrays, dict(causal=True), backend="numba-mma", splits=(2,))


def test_window_and_softcap_on_a_paged_cache(rng):
    arrays = _make(rng, "float16", 2, 2, 2, 1, 96, 0, paged=True, block_size=32,
                   full_first=True)
    _check("float16", arrays, dict(window_size=(20, 0), softcap=3.0), backend="numba-mma",
           splits=(7,))


def test_alibi_per_sequence_and_head(rng):
    """Each row's own head's slope: GQA 16, so a lane's two rows (g and g + 8) are two
    heads."""
    arrays = _make(rng, "float16", 2, 1, 16, 1, 48, 1, paged=False, full_first=True)
    slopes = rng.uniform(0.05, 0.5, (2, 16)).astype(np.float32)
    _check("float16", arrays, dict(alibi_slopes=slopes), backend="numba-mma", splits=(0,))


def test_a_chunk_of_33_tokens(rng):
    """Chunked prefill: 33 causal rows, three row tiles of the block."""
    arrays = _make(rng, "float16", 1, 33, 1, 1, 80, 33, paged=False, full_first=True)
    _check("float16", arrays, dict(causal=True), backend="numba-mma", splits=(0,))


def test_q_from_shared_memory_above_head_dim_128(rng):
    assert 144 > tensor_cores.Q_IN_REGISTERS_MAX
    arrays = _make(rng, "bfloat16", 1, 1, 2, 1, 48, 1, paged=True, full_first=True,
                   head_dim=144)
    _check("bfloat16", arrays, dict(causal=True), backend="numba-mma", splits=(1,))
