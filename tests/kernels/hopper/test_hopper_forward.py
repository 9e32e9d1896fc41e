"""The Hopper forward kernel (backends/numba/hopper/fwd.py) against the float64 reference:
under the simulator at small sizes (the twins of wgmma, mbarriers, the copy engine and
cp.async; three
warpgroups of Python threads, so a few cases, with every variant the engine takes), and with
`-m gpu` on an sm_90 GPU at real sizes (the variants at real sizes: through the API,
tests/variants/test_gpu_variants.py, whose "numba" takes this kernel there)."""
import functools

import numpy as np
import pytest
from mma_cases import run_forward, sequence_map_rows
from mask_mods import document_mask, gapped_mask

from numba_flash.backends.numba.hopper.config import (BACKWARD_MASK_MOD_GQA_CP_ASYNC_REGISTERS,
                                                      HopperConfig, hopper_backward_config,
                                                      hopper_forward_config)
from numba_flash.backends.numba.hopper.fwd import (hopper_forward_kernel,
                                                   hopper_forward_kernel_function,
                                                   hopper_forward_launch,
                                                   launch_hopper_forward)
from numba_flash.backends.numba.hopper.tensor_maps import map_templates
from numba_flash.spec import AttentionSpec

# (batch, seqlen_q, seqlen_k, nheads, head_dim), kv_heads, causal, dtype, config, options
# (the consumers taking turns, and not: config.turns)
SIMULATOR_CASES = [
    ((1, 70, 50, 1, 64), None, False, "float16", HopperConfig(32), {}),  # a partial last
    #                                                                     key tile
    ((1, 130, 100, 2, 64), 1, True, "bfloat16", HopperConfig(32), {}),  # two query tiles,
    #                                  GQA, rows that see no key (seqlen_q > seqlen_k)
    ((1, 40, 90, 1, 128), None, True, "float16", HopperConfig(64), {}),
    ((1, 60, 75, 2, 64), 1, False, "float16", HopperConfig(32, turns=False),
     dict(window_left=20, window_right=5, softcap=2.0, alibi=True)),
    ((4, 40, 50, 1, 64), None, True, "bfloat16", HopperConfig(32),
     dict(lengths=[(33, 40), (0, 7), (40, 50), (9, 0)])),  # varlen (maps per sequence),
    #                                                            empty sequences
    ((2, 70, 50, 2, 64), 1, True, "float16", HopperConfig(32, copy_engine=False), {}),
    ((1, 200, 150, 1, 64), None, True, "bfloat16", HopperConfig(64, consumers=3), {}),  # d64's
    #                          three consumers taking turns round a ring, two query tiles
]

# masks: mask_mods, gapped_mask's tile table leaving an empty key tile inside each head's key
# range (GQA: a different one per head) and a query tile with no key at all; a boolean
# attn_mask (the other attn_masks go through the same shared mask and score mod as the other
# families', tests/variants, and run through these kernels in the GPU variant suite)
MASK_CASES = [
    ((1, 130, 100, 2, 64), 1, False, "float16", HopperConfig(32),
     dict(mask_mod=gapped_mask, softcap=2.0)),
    ((1, 80, 80, 1, 64), None, True, "bfloat16", HopperConfig(32, turns=False),
     dict(mask_mod=document_mask)),
    # a boolean mask on the plain tiles and turns (the config a boolean mask takes)
    ((1, 70, 150, 2, 64), 1, True, "float16", HopperConfig(128), dict(attn_mask="bool")),
]

# under causal, grids of few waves with their query tiles along grid.y and heads along x
# (grids.py; a large multiprocessor count makes these grids few): tiles from the end of Q (the
# copy engine), from row 0 (a mask_mod's tables; cp.async), GQA; grids not square
ORDER_CASES = [
    ((1, 130, 100, 3, 64), 1, True, "float16", HopperConfig(32), {}),
    ((1, 200, 150, 3, 64), 1, True, "bfloat16", HopperConfig(32),
     dict(mask_mod=gapped_mask)),  # (two tiles and three heads whose tables differ)
    ((1, 150, 90, 3, 64), None, True, "float16", HopperConfig(32, copy_engine=False), {}),
    ((3, 130, 60, 3, 64), 1, True, "float16", HopperConfig(32),
     dict(lengths=[(130, 60), (0, 7), (40, 0)])),  # varlen, empty sequences
    ((3, 130, 60, 3, 64), 1, True, "float16", HopperConfig(32, copy_engine=False),
     dict(lengths=[(100, 60), (30, 7), (0, 0)])),  # varlen on cp.async (refused maps)
]

GPU_SHAPES = [(2, 1000, 1000, 4, 64), (1, 2048, 2048, 8, 128), (1, 777, 1500, 4, 128),
              (1, 1500, 700, 4, 128), (1, 600, 900, 4, 256)]


@pytest.mark.parametrize("shape, kv_heads, causal, dtype, config, options", SIMULATOR_CASES,
                         ids=[f"sim-{'x'.join(map(str, c[0]))}-{c[2]}-{c[3]}-{len(c[5])}"
                              f"{'' if c[4].turns else '-no-turns'}"
                              f"{'' if c[4].copy_engine else '-cp-async'}"
                              for c in SIMULATOR_CASES])
def test_hopper_forward_in_the_simulator(rng, shape, kv_heads, causal, dtype, config,
                                         options):
    run_forward(rng, shape, causal, dtype, config, kv_heads,
                launch=launch_hopper_forward, **options)


@pytest.mark.parametrize("shape, kv_heads, causal, dtype, config, options", MASK_CASES,
                         ids=[f"sim-{'x'.join(map(str, c[0]))}-{c[2]}-{c[3]}-"
                              f"{'-'.join(getattr(x, '__name__', str(x)) for x in c[5].values())}"
                              for c in MASK_CASES])
def test_hopper_forward_with_masks_in_the_simulator(rng, shape, kv_heads, causal, dtype,
                                                    config, options):
    run_forward(rng, shape, causal, dtype, config, kv_heads,
                launch=launch_hopper_forward, **options)


@pytest.mark.parametrize("shape, kv_heads, causal, dtype, config, options", ORDER_CASES,
                         ids=[f"sim-{'x'.join(map(str, c[0]))}-{len(c[5])}"
                              f"{'' if c[4].copy_engine else '-cp-async'}"
                              for c in ORDER_CASES])
def test_hopper_forward_with_query_tiles_slowest_in_the_simulator(rng, shape, kv_heads, causal,
                                                                  dtype, config, options):
    run_forward(rng, shape, causal, dtype, config, kv_heads,
                launch=functools.partial(launch_hopper_forward, multiprocessors=1000),
                **options)


@pytest.mark.parametrize("causal, multiprocessors, slowest", [
    (True, 132, True),    # a training step's 22 tiles x 16 heads: under three waves
    (True, 40, False),    # nine waves: the plain grid
    (True, 0, False),     # the simulator: no layout
    (False, 132, False),  # blocks alike: the plain grid
])
def test_a_causal_forward_of_few_waves_lays_its_query_tiles_along_y(causal, multiprocessors,
                                                                    slowest):
    q = np.zeros((1, 4096, 16, 64), np.uint16)
    lse = np.zeros((1, 16, 4096), np.float32)
    spec = AttentionSpec(64, "float16", causal=causal, softmax_scale=0.125)
    config, kernel, grid, *_ = hopper_forward_launch(spec, q, q, q, q, lse,
                                                     multiprocessors=multiprocessors)
    tiles = -(-4096 // config.block_m)
    assert grid == ((16, tiles, 1) if slowest else (tiles, 16, 1))
    assert kernel is hopper_forward_kernel(config, spec.for_kernels(head_dim=64), slowest)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["x".join(map(str, s)) for s in GPU_SHAPES])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_forward_on_the_gpu(rng, shape, causal, dtype):
    _needs_sm90()
    run_forward(rng, shape, causal, dtype, None, launch=launch_hopper_forward)


def _needs_sm90():
    from numba import cuda
    if tuple(cuda.get_current_device().compute_capability) != (9, 0):
        pytest.skip("the Hopper kernels need compute capability 9.0")


def test_head_dims_and_tiles_the_kernels_refuse():
    with pytest.raises(ValueError, match="head_dim and block_n must be multiples of 16"):
        hopper_forward_kernel_function(HopperConfig(block_n=40), AttentionSpec(64, "float16"))
    with pytest.raises(ValueError, match="the tile loader takes head dims of 64, 128 or 256; "
                                         "got 96"):
        hopper_forward_kernel_function(HopperConfig(block_n=64), AttentionSpec(96, "float16"))
    with pytest.raises(ValueError, match="no Hopper forward config for head_dim 272"):
        q = np.zeros((1, 16, 1, 272), np.uint16)
        launch_hopper_forward(AttentionSpec(272, "float16", softmax_scale=0.1), q, q, q, q,
                              np.zeros((1, 1, 16), np.float32))


def test_the_copy_engine_takes_what_it_can_read():
    """The forward's producer takes the copy engine wherever its maps encode (contiguous or
    strided 16-byte rows; varlen too, its maps per sequence, on two consumers), cp.async for
    strides that are not multiples of 16 bytes (so the simulator cases above run the copy
    engine but for those marked cp-async)."""
    q = np.zeros((2, 100, 4, 64), np.uint16)
    strided = np.zeros((2, 100, 8, 64), np.uint16)[:, :, ::2]
    odd = np.zeros((2, 100, 4, 68), np.uint16)[..., :64]  # (rows 136 bytes apart)
    assert map_templates(((q, 128), (strided, 64), (strided, 64))) is not None
    assert map_templates(((q, 128), (odd, 64), (q, 64))) is None
    # (d64's three consumers come with the copy engine only: the table of cp.async has two)
    for head_dim in (64, 128, 256):
        dense = hopper_forward_config(head_dim, AttentionSpec(head_dim, "float16"))
        varlen = hopper_forward_config(head_dim, AttentionSpec(head_dim, "float16",
                                                               varlen=True))
        refused = hopper_forward_config(head_dim, AttentionSpec(head_dim, "float16"),
                                        copy_engine=False)
        assert dense.copy_engine and varlen.copy_engine and not refused.copy_engine
        assert varlen.consumers == refused.consumers == 2 and refused.registers
    assert hopper_forward_config(64, AttentionSpec(64, "float16")).consumers == 3


def test_a_mask_mod_takes_wider_tiles_only_on_the_copy_engine():
    """A mask_mod's kernels compile clean on d128 64-key tiles only with the copy engine's
    consumer registers (varlen's too); with cp.async (refused maps), or an attn_mask beside
    it, they keep the masked table's narrower tiles (those take every variant without
    spills). Without GQA its dK/dV kernel takes wider query tiles."""
    for head_dim in (64, 128):
        spec = AttentionSpec(head_dim, "float16", causal=True, mask_mod=document_mask)
        masked = AttentionSpec(head_dim, "float16", causal=True, attn_mask="float16")
        both = AttentionSpec(head_dim, "float16", causal=True, attn_mask="float16",
                             mask_mod=document_mask)
        varlen = AttentionSpec(head_dim, "float16", causal=True, mask_mod=document_mask,
                               varlen=True)
        for config_of in (hopper_forward_config, hopper_backward_config):  # (dQ: block_n)
            narrow = config_of(head_dim, masked).block_n
            assert config_of(head_dim, both).block_n == narrow
            assert config_of(head_dim, varlen, copy_engine=False).block_n == narrow
            assert config_of(head_dim, spec, copy_engine=False).block_n == narrow
            assert config_of(head_dim, spec).copy_engine
            assert config_of(head_dim, varlen) == config_of(head_dim, spec)
            wide = config_of(head_dim, spec).block_n
            assert wide == 64 and (wide > narrow) == (head_dim == 128)
        # dK/dV: twice the masked table's query tiles without GQA (the lean producer spilled
        # walking a group's heads)
        gqa = AttentionSpec(head_dim, "float16", causal=True, mask_mod=document_mask, group=4)
        masked_rows = hopper_backward_config(head_dim, masked).block_m
        assert hopper_backward_config(head_dim, gqa).block_m == masked_rows
        assert hopper_backward_config(head_dim, spec).block_m == 2 * masked_rows
        assert hopper_backward_config(head_dim, gqa).wide_producer
        assert not hopper_backward_config(head_dim, spec).wide_producer
        # with cp.async and GQA d128's consumers take registers from the producer
        varlen_gqa = AttentionSpec(head_dim, "float16", causal=True, mask_mod=document_mask,
                                   group=4, varlen=True)
        masked_registers = hopper_backward_config(head_dim, masked, copy_engine=False).registers
        split = BACKWARD_MASK_MOD_GQA_CP_ASYNC_REGISTERS.get(head_dim, masked_registers)
        assert (head_dim == 128) == (split != masked_registers)
        for spec_gqa in (gqa, varlen_gqa):
            assert hopper_backward_config(head_dim, spec_gqa,
                                          copy_engine=False).registers == split
        # (varlen with both keeps cp.async: its dK/dV spilled on the copy engine)
        assert hopper_backward_config(head_dim, varlen_gqa) == hopper_backward_config(
            head_dim, varlen_gqa, copy_engine=False)
        assert not hopper_backward_config(head_dim, varlen_gqa).copy_engine
        assert hopper_backward_config(head_dim, varlen, copy_engine=False).registers == \
            masked_registers
        assert hopper_backward_config(head_dim, gqa).registers != \
            BACKWARD_MASK_MOD_GQA_CP_ASYNC_REGISTERS[128]


def test_the_roles_share_the_registers_the_block_holds(monkeypatch):
    """setmaxnreg moves registers within what a block holds at launch (168 a thread for 384
    threads): a split that asks more would leave the consumers' inc waiting for ever (a hang
    the simulator cannot show), so the config refuses it."""
    from numba_flash.backends.numba.hopper import config as hopper_config
    for config in (HopperConfig(64), HopperConfig(64, copy_engine=False),
                   HopperConfig(128, consumers=3), hopper_config.HopperBackwardConfig(64, 64)):
        producer, consumer = config.registers
        assert 128 * (producer + config.consumers * consumer) <= 65536 // config.threads * \
            config.threads
    monkeypatch.setitem(hopper_config.COPY_ENGINE_REGISTERS, 2, (32, 240))
    with pytest.raises(ValueError, match="exceed the 64512 a block of 384 threads holds"):
        HopperConfig(64).registers


def test_a_varlen_sequence_never_reads_the_next_ones_keys(rng):
    """A varlen sequence's tensor maps end at its last row (tensor_maps.py), as cp.async's
    loaders stop there: a box that ran on into the next sequence's rows would bring its
    non-finite values into this sequence's output (0 · NaN). The second sequence's keys and
    values are NaN here."""
    import numba_flash
    q = rng.standard_normal((60, 1, 64)).astype(np.float16)
    k, v = (rng.standard_normal((80, 1, 64)).astype(np.float16) for _ in range(2))
    k[50:], v[50:] = np.nan, np.nan
    cu_q, cu_k = np.array([0, 40, 60], np.int32), np.array([0, 50, 80], np.int32)
    out, _ = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, 40, 50, backend="numba-hopper")
    want, _ = numba_flash.forward(q[None, :40], k[None, :50], v[None, :50], backend="numpy")
    assert np.isfinite(out[:40]).all()
    np.testing.assert_allclose(out[:40].astype(np.float64), want[0], atol=2e-3)


def test_each_varlen_sequence_publishes_its_own_maps(rng, monkeypatch):
    """The slots of sequence s (s * MAP_COUNT..) hold maps of its own rows: q's, then k's and
    v's (a sequence without queries leaves before it writes any: its slots are scratch left
    as allocated; one without keys gets maps of one row, never copied through)."""
    import numba_flash
    from numba_flash.backends.numba.hopper import engine
    seen = []

    def spy(*args, maps=None, **kwargs):
        seen.append(maps)
        return launch_hopper_forward(*args, maps=maps, **kwargs)
    monkeypatch.setattr(engine, "launch_hopper_forward", spy)
    lengths_q, lengths_k = [20, 0, 45, 7], [30, 9, 0, 7]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
                  for n in (lengths_q, lengths_k))
    q = rng.standard_normal((cu_q[-1], 2, 64)).astype(np.float16)
    k, v = (rng.standard_normal((cu_k[-1], 1, 64)).astype(np.float16) for _ in range(2))
    numba_flash.forward_varlen(q, k, v, cu_q, cu_k, 45, 30, backend="numba-hopper")
    rows = sequence_map_rows(seen[0], 3)
    for s, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        if n_q:
            assert list(rows[s]) == [n_q, max(n_k, 1), max(n_k, 1)], (s, list(rows[s]))


def test_map_slots_too_few_for_the_sequences_are_refused():
    from numba_flash.backends.numba.hopper.tensor_maps import check_map_slots, map_slots
    check_map_slots(map_slots(np.zeros(1), 3), 3)
    with pytest.raises(ValueError, match="maps: 12 slots for 3 sequences"):
        check_map_slots(map_slots(np.zeros(1), 2), 3)


def test_the_api_takes_the_copy_engine(rng, monkeypatch):
    """A plain call through "numba-hopper" encodes its maps (the copy engine), and a driver
    refusal falls back to cp.async with one warning per shape."""
    import numba_flash
    from numba_flash.backends.numba.hopper import fwd, tensor_maps
    chosen = []

    def spy(arrays_and_rows):
        chosen.append(tensor_maps.map_templates(arrays_and_rows))
        return chosen[-1]
    monkeypatch.setattr(fwd, "map_templates", spy)
    q, k, v = (rng.standard_normal((1, 30, 1, 64)).astype(np.float16) for _ in range(3))
    numba_flash.forward(q, k, v, backend="numba-hopper")
    assert len(chosen) == 1 and chosen[0] is not None and len(chosen[0]) == 3

    def refuse(*args):
        raise tensor_maps.TensorMapRefused("a refusal")
    tensor_maps._template.cache_clear()
    monkeypatch.setattr(tensor_maps, "tensor_map_template", refuse)
    with pytest.warns(RuntimeWarning, match="a refusal: these calls copy with cp.async"):
        assert tensor_maps.map_templates(((q, 128),)) is None
    tensor_maps._template.cache_clear()
