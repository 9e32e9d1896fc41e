"""The Hopper backward kernels (backends/numba/hopper/bwd_dk_dv.py, bwd_dq.py) against the
float64 reference: under the simulator at small sizes (a few cases: three warpgroups of
Python threads each, every variant the engine takes among them), and with `-m gpu` on an
sm_90 GPU at real sizes."""
import functools

import pytest
from mma_cases import run_backward, sequence_map_rows
from mask_mods import gapped_mask

from numba_flash.backends.numba.device.group_sums import launch_group_sums
from numba_flash.backends.numba.hopper.bwd import launch_hopper_backward
from numba_flash.backends.numba.hopper.config import (BACKWARD_MASK_MOD_GQA_CP_ASYNC_REGISTERS,
                                                      HopperBackwardConfig,
                                                      hopper_backward_config)
from numba_flash.backends.numba.hopper.grids import BackwardGrid, backward_grid
from numba_flash.spec import AttentionSpec

# (batch, seqlen_q, seqlen_k, nheads, head_dim), kv_heads, causal, dtype, config, options
# (each case simulates three warpgroups of Python threads through two kernels: a few cases,
# the variants' rules being the shared device modules', which tests/variants and the GPU
# variant suite run through these kernels; the producers copy with the copy engine but in
# the cases marked cp.async; varlen's maps per sequence, tensor_maps.py)
SIMULATOR_CASES = [
    ((1, 40, 90, 2, 64), 1, True, "bfloat16", HopperBackwardConfig(32, 32),
     dict(window_left=20, softcap=2.0, alibi=True)),  # GQA, a window, softcap, ALiBi
    ((1, 50, 60, 1, 128), None, True, "float16", HopperBackwardConfig(32, 64), {}),
    ((1, 50, 60, 1, 128), None, False, "float16",
     HopperBackwardConfig(32, 64, copy_engine=False), {}),  # cp.async
    ((4, 40, 50, 1, 64), None, True, "bfloat16", HopperBackwardConfig(32, 32),
     dict(lengths=[(33, 40), (0, 7), (40, 50), (9, 0)], alibi=True)),  # varlen, empty
    #   sequences; with ALiBi, the dQ kernel's consumers do not take turns
    ((3, 40, 50, 2, 64), 1, True, "float16", HopperBackwardConfig(32, 32, copy_engine=False),
     dict(lengths=[(40, 33), (7, 0), (20, 50)])),  # varlen on cp.async (refused maps)
    ((1, 50, 150, 2, 64), 1, True, "float16", HopperBackwardConfig(64, 128, stages=4),
     dict(softcap=2.0)),  # d64's 128-key dQ tiles (the second one partial), GQA, softcap
]

# masks: a mask_mod whose tile tables leave an empty tile inside the ranges of both kernels
# (the other masks' code is the forward's, tests/kernels/hopper/test_hopper_forward.py, and
# the tensor-core backward's; all of them run through these kernels in the GPU variant suite)
MASK_CASES = [  # (16-query tiles for dK/dV, as the masked d128 config's; GQA: each query
    #              head of the group its own empty key tile)
    ((1, 70, 100, 2, 64), 1, False, "float16", HopperBackwardConfig(16, 32),
     dict(mask_mod=gapped_mask, softcap=2.0)),
]

GPU_SHAPES = [(2, 1000, 1000, 4, 64), (1, 2048, 2048, 8, 128), (1, 777, 1500, 4, 128),
              (1, 1500, 700, 4, 128)]


@pytest.mark.parametrize("shape, kv_heads, causal, dtype, config, options", SIMULATOR_CASES,
                         ids=[f"sim-{'x'.join(map(str, c[0]))}-{c[2]}-{c[3]}-{len(c[5])}"
                              for c in SIMULATOR_CASES])
def test_hopper_backward_in_the_simulator(rng, shape, kv_heads, causal, dtype, config,
                                          options):
    run_backward(rng, shape, causal, dtype, config, kv_heads, launch=launch_hopper_backward,
                 **options)


@pytest.mark.parametrize("shape, kv_heads, causal, dtype, config, options", MASK_CASES,
                         ids=[f"sim-{'x'.join(map(str, c[0]))}-{c[2]}-{c[3]}-"
                              f"{'-'.join(getattr(x, '__name__', str(x)) for x in c[5].values())}"
                              for c in MASK_CASES])
def test_hopper_backward_with_masks_in_the_simulator(rng, shape, kv_heads, causal, dtype,
                                                     config, options):
    run_backward(rng, shape, causal, dtype, config, kv_heads, launch=launch_hopper_backward,
                 **options)


# the grids' layouts where blocks are few (hopper/grids.py): a GQA group split over blocks
# (float32 parts, then their sums), tiles along grid.y or x: (batch, seqlen_q, seqlen_k,
# nheads, head_dim), kv_heads, causal, dtype, grid, options. Two key heads where the split
# is (their slots apart), grids not square (x and y apart); the split of a group of four is
# test_the_engine_splits_a_short_gqa_grid's.
SPLIT_CASES = [
    ((1, 40, 100, 4, 64), 2, True, "bfloat16", BackwardGrid(2, True, True), {}),
    ((4, 40, 50, 2, 64), 1, True, "float16", BackwardGrid(2, True, True),
     dict(lengths=[(33, 40), (0, 7), (40, 50), (9, 0)])),  # varlen, empty sequences
    ((4, 40, 50, 2, 64), 1, True, "float16", BackwardGrid(2, False, True),
     dict(lengths=[(33, 40), (0, 7), (40, 50), (9, 0)])),
    ((1, 70, 100, 2, 64), 1, False, "float16", BackwardGrid(2, True),
     dict(mask_mod=gapped_mask)),  # (its query heads' tables differ)
]


@pytest.mark.parametrize("shape, kv_heads, causal, dtype, grid, options", SPLIT_CASES,
                         ids=[f"sim-{'x'.join(map(str, c[0]))}-split{c[4].split}"
                              f"{'-keys-slowest' if c[4].keys_slowest else ''}"
                              f"{'-queries-slowest' if c[4].queries_slowest else ''}"
                              for c in SPLIT_CASES])
def test_hopper_backward_with_a_split_group_in_the_simulator(rng, shape, kv_heads, causal,
                                                             dtype, grid, options):
    import numpy as np

    def poisoned(shape, dtype):  # (a part no block writes would reach the sums as NaN)
        return np.full(shape, np.nan, dtype)
    run_backward(rng, shape, causal, dtype, HopperBackwardConfig(32, 32), kv_heads,
                 launch=functools.partial(launch_hopper_backward, grid=grid,
                                          scratch=poisoned), **options)


def test_a_split_that_does_not_divide_the_group_is_refused():
    import numpy as np
    spec = AttentionSpec(64, "float16", softmax_scale=0.1, group=4)
    q, kv = np.zeros((1, 16, 4, 64), np.uint16), np.zeros((1, 16, 1, 64), np.uint16)
    lse = np.zeros((1, 4, 16), np.float32)
    with pytest.raises(ValueError, match="a split of 3 does not divide the GQA group of 4"):
        launch_hopper_backward(spec, q, q, kv, kv, q, lse, lse, q, kv, kv,
                               grid=BackwardGrid(3))


@pytest.mark.parametrize("causal, blocks, group, dq_blocks, multiprocessors, expected", [
    # a training step's GQA at batch 1: fill the GPU
    (True, 128, 4, 512, 132, BackwardGrid(2, True, True)),
    (True, 40, 8, 600, 132, BackwardGrid(4, True, False)),  # the smallest split that fills it
    (True, 40, 2, 80, 132, BackwardGrid(2, True, True)),    # the whole group, still short
    (True, 256, 4, 1024, 132, BackwardGrid(1, True, False)),  # full already: longest first
    (True, 1024, 4, 4096, 132, BackwardGrid(1, False, False)),  # many waves: plain grids
    (True, 100, 1, 100, 132, BackwardGrid(1, True, True)),  # no group to split
    (False, 60, 4, 240, 132, BackwardGrid(2, False, False)),  # the largest split in one wave
    (False, 128, 4, 512, 132, BackwardGrid(1, False, False)),  # one wave already
    (True, 128, 4, 512, 0, BackwardGrid(1, False, False)),    # the simulator: no layout
])
def test_the_backward_grids_fill_the_gpu(causal, blocks, group, dq_blocks, multiprocessors,
                                         expected):
    spec = AttentionSpec(64, "float16", causal=causal, group=group)
    assert backward_grid(spec, blocks, 1, dq_blocks, 1, 1, multiprocessors) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["x".join(map(str, s)) for s in GPU_SHAPES])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_backward_on_the_gpu(rng, shape, causal, dtype):
    from numba import cuda
    if tuple(cuda.get_current_device().compute_capability) != (9, 0):
        pytest.skip("the Hopper kernels need compute capability 9.0")
    run_backward(rng, shape, causal, dtype, None, launch=launch_hopper_backward)


def test_head_dims_without_a_backward_config_are_refused():
    import numpy as np

    from numba_flash.spec import AttentionSpec
    q = np.zeros((1, 16, 1, 256), np.uint16)
    lse = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match="no Hopper backward config for head_dim 256"):
        launch_hopper_backward(AttentionSpec(256, "float16", softmax_scale=0.1), q, q, q, q, q,
                               lse, lse, q, q, q)


def test_the_backward_refuses_fewer_than_three_stages():
    with pytest.raises(ValueError, match="needs 3 stages or more"):
        HopperBackwardConfig(32, 64, stages=2)


def test_d64_takes_128_key_dq_tiles_where_they_compile_clean():
    """d64's dQ kernel takes 128-key tiles and four stages with softcap or GQA beside causal
    and not with a window, ALiBi or varlen (where ptxas spilled: config.py); d128 keeps its
    tiles either way."""
    for options in ({}, dict(causal=True), dict(causal=True, softcap=30.0, group=4)):
        config = hopper_backward_config(64, AttentionSpec(64, "float16", **options))
        assert (config.block_m, config.block_n, config.stages) == (64, 128, 4), options
    for options in (dict(causal=True, window_left=256), dict(alibi=True),
                    dict(causal=True, varlen=True), dict(window_right=8)):
        config = hopper_backward_config(64, AttentionSpec(64, "float16", **options))
        assert (config.block_n, config.stages) == (64, 3), options
    assert hopper_backward_config(128, AttentionSpec(128, "float16")) == \
        hopper_backward_config(128, AttentionSpec(128, "float16", alibi=True))


def test_the_backward_takes_the_copy_engine(rng, monkeypatch):
    """A plain backward through "numba-hopper" encodes the maps of both kernels (q, dout, k,
    v each, with their boxes), and its producers keep registers the block holds."""
    import numpy as np

    import numba_flash
    from numba_flash.backends.numba.hopper import bwd, tensor_maps
    chosen = []

    def spy(arrays_and_rows):
        chosen.append(tensor_maps.map_templates(arrays_and_rows))
        return chosen[-1]
    monkeypatch.setattr(bwd, "map_templates", spy)
    q, k, v, dout = (rng.standard_normal((1, 30, 1, 64)).astype(np.float16) for _ in range(4))
    out, lse = numba_flash.forward(q, k, v, backend="numba-hopper")
    numba_flash.backward(dout, q, k, v, out, lse, backend="numba-hopper")
    assert len(chosen) == 1 and chosen[0] is not None and len(chosen[0]) == 8
    for config in (HopperBackwardConfig(64, 64), HopperBackwardConfig(64, 64, copy_engine=False),
                   HopperBackwardConfig(16, 32, wide_producer=True),
                   HopperBackwardConfig(16, 32, copy_engine=False, register_split=(
                       BACKWARD_MASK_MOD_GQA_CP_ASYNC_REGISTERS[128]))):
        producer, consumer = config.registers
        assert 128 * (producer + 2 * consumer) <= 168 * 384
    assert HopperBackwardConfig(64, 64).registers[1] > HopperBackwardConfig(
        64, 64, wide_producer=True).registers[1]


@pytest.fixture
def sums(monkeypatch):
    """The splits of the group sums the backward launches (each launch's split, in order)."""
    from numba_flash.backends.numba.hopper import bwd
    launched = []

    def spy(spec, split, *args):
        launched.append(split)
        launch_group_sums(spec, split, *args)
    monkeypatch.setattr(bwd, "launch_group_sums", spy)
    return launched


def test_the_engine_splits_a_short_gqa_grid(rng, monkeypatch, sums):
    """Through numba_flash.backward ("numba-hopper"), a GPU of more multiprocessors than the
    dK/dV blocks gets the group split and its sums (the parts from the engine's scratch);
    the gradients keep the accuracy rule against float64."""
    import numpy as np

    import numba_flash
    from error_rule import assert_within_rule

    from numba_flash.backends.numba.hopper import engine
    from numba_flash.reference import attention_backward
    from numba_flash.spec import make_spec
    from numba_flash.testing import plain16_backward
    monkeypatch.setattr(engine, "grid_multiprocessors", lambda q: 8)
    q, dout = (rng.standard_normal((1, 40, 4, 64)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, 70, 1, 64)).astype(np.float16) for _ in range(2))
    out, lse = numba_flash.forward(q, k, v, causal=True, backend="numba-hopper")
    grads = numba_flash.backward(dout, q, k, v, out, lse, causal=True, backend="numba-hopper")
    assert sums == [4]  # (one key tile, one key head: the whole group split)
    spec = make_spec(q, k, causal=True)
    f64 = [x.astype(np.float64) for x in (dout, q, k, v, out)]
    wants = attention_backward(np, *f64, lse, spec, np.float64)
    bases = plain16_backward(np, *f64, lse, spec, "float16")
    for name, got, base, want in zip(("dq", "dk", "dv"), grads, bases, wants):
        assert_within_rule(name, got.astype(np.float32), base, want, "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1500, 8, 2, 64), (1, 900, 8, 2, 128), (2, 700, 4, 1, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_a_short_gqa_grid_on_the_gpu_and_its_replay(rng, sums, shape):
    """At batch 1-2 with GQA the dK/dV blocks are fewer than an H100's multiprocessors: the
    engine splits the group (its sums launched; the layout as grids.py picks it) and keeps
    the accuracy rule against float64; the call's replay gives the same gradients bit for
    bit."""
    import cupy as cp
    import numpy as np
    from numba import cuda

    import numba_flash
    from error_rule import assert_within_rule

    from numba_flash.backends.numba.gpu import multiprocessors
    from numba_flash.reference import attention_backward
    from numba_flash.spec import make_spec
    from numba_flash.testing import plain16_backward
    if tuple(cuda.get_current_device().compute_capability) != (9, 0):
        pytest.skip("the Hopper kernels need compute capability 9.0")
    batch, seqlen, nheads, kv_heads, head_dim = shape
    q, dout = (rng.standard_normal((batch, seqlen, nheads, head_dim)).astype(np.float16)
               for _ in range(2))
    k, v = (rng.standard_normal((batch, seqlen, kv_heads, head_dim)).astype(np.float16)
            for _ in range(2))
    spec = make_spec(q, k, causal=True)
    tiles = -(-seqlen // 128)
    grid = backward_grid(spec, tiles, kv_heads, tiles, nheads, batch,
                         multiprocessors(cp.cuda.Device().id))
    assert grid == BackwardGrid(grid.split, True, True) and grid.split > 1
    args = [cp.asarray(x) for x in (dout, q, k, v)]
    out, lse = numba_flash.forward(*args[1:], causal=True, backend="numba-hopper")
    grads = [[cp.asnumpy(g) for g in numba_flash.backward(*args, out, lse, causal=True,
                                                          backend="numba-hopper")]
             for _ in range(2)]
    assert sums == [grid.split]  # (the first call's; the second is its replay)
    f64 = [x.astype(np.float64) for x in (dout, q, k, v, cp.asnumpy(out))]
    wants = attention_backward(np, *f64, cp.asnumpy(lse), spec, np.float64)
    bases = plain16_backward(np, *f64, cp.asnumpy(lse), spec, "float16")
    for name, got, again, base, want in zip(("dq", "dk", "dv"), *grads, bases, wants):
        assert_within_rule(name, got.astype(np.float32), base, want, "float16")
        np.testing.assert_array_equal(again, got)


def test_a_varlen_sequence_never_reads_the_next_ones_rows(rng):
    """The backward's tensor maps end at each sequence's last row too (tensor_maps.py): its
    dK/dV kernel's query tiles and its dQ kernel's key tiles stop there, so that the next
    sequence's non-finite q, k, v and dout (NaN here, and so its out and lse) never reach
    this sequence's gradients (0 · NaN)."""
    import numpy as np

    import numba_flash
    from numba_flash.reference import attention_backward
    from numba_flash.spec import make_spec
    q, dout = (rng.standard_normal((60, 1, 64)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((80, 1, 64)).astype(np.float16) for _ in range(2))
    q[40:], dout[40:], k[50:], v[50:] = np.nan, np.nan, np.nan, np.nan
    cu_q, cu_k = np.array([0, 40, 60], np.int32), np.array([0, 50, 80], np.int32)
    out, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, 40, 50, causal=True,
                                          backend="numba-hopper")
    grads = numba_flash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 40, 50,
                                        causal=True, backend="numba-hopper")
    first = [x[None, :n].astype(np.float64)
             for x, n in ((dout, 40), (q, 40), (k, 50), (v, 50), (out, 40))]
    wants = attention_backward(np, *first, lse[None, :, :40].astype(np.float64),
                               make_spec(first[1], first[2], causal=True), np.float64)
    for name, got, n, want in zip(("dq", "dk", "dv"), grads, (40, 50, 50), wants):
        assert np.isfinite(got[:n]).all(), name
        np.testing.assert_allclose(got[:n].astype(np.float64), want[0], atol=5e-3, err_msg=name)


def test_each_varlen_sequence_publishes_its_own_backward_maps(rng, monkeypatch):
    """Both backward kernels publish each sequence's maps to its own slots (q, dout, k, v):
    the dK/dV kernel's blocks of a sequence with keys, the dQ kernel's of one with queries
    (the others leave before they write any; an empty side's maps get one row, never copied
    through)."""
    import numpy as np

    import numba_flash
    from numba_flash.backends.numba.hopper import engine
    seen = []

    def spy(*args, maps=None, **kwargs):
        seen.append(maps)
        return launch_hopper_backward(*args, maps=maps, **kwargs)
    monkeypatch.setattr(engine, "launch_hopper_backward", spy)
    lengths_q, lengths_k = [20, 0, 45, 7], [30, 9, 0, 7]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
                  for n in (lengths_q, lengths_k))
    q, dout = (rng.standard_normal((cu_q[-1], 2, 64)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((cu_k[-1], 1, 64)).astype(np.float16) for _ in range(2))
    out, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, 45, 30, backend="numba-hopper")
    numba_flash.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 45, 30,
                                backend="numba-hopper")
    dk_dv_rows, dq_rows = (sequence_map_rows(maps, 4) for maps in seen[0])
    for s, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        want = [max(n_q, 1)] * 2 + [max(n_k, 1)] * 2
        if n_k:
            assert list(dk_dv_rows[s]) == want, ("dK/dV", s, list(dk_dv_rows[s]))
        if n_q:
            assert list(dq_rows[s]) == want, ("dQ", s, list(dq_rows[s]))
