"""The Hopper forward's key tiles for a mask_mod (backends/numba/hopper/key_tiles.py): the
plain table's 128-key tiles where the call's kernel compiles without local memory there, else
the mask_mod table's 64-key tiles. The simulator compiles nothing, so its probe is stood in
for here; left alone there, it keeps the 64-key tiles."""
import numpy as np
import pytest
from mask_mods import document_mask, gapped_mask
from mma_cases import Layout

import numba_flash
from numba_flash.backends.numba.hopper import engine, key_tiles
from numba_flash.backends.numba.hopper.config import HopperConfig
from numba_flash.backends.numba.hopper.fwd import hopper_forward_launch
from numba_flash.spec import AttentionSpec

#: the plain table's tiles (d64: three consumers) and the mask_mod table's
WIDE = {64: HopperConfig(128, consumers=3), 128: HopperConfig(128)}
NARROW = HopperConfig(64)


@pytest.fixture
def local_memory(monkeypatch):
    """The probe stood in for: the bytes it reports go in `reported`, what it was asked in
    `asked` (kernel, argument types, device)."""
    probe = {"reported": 0, "asked": []}

    def stand_in(kernel, argtypes, device):
        probe["asked"].append((kernel, argtypes, device))
        return probe["reported"]
    monkeypatch.setattr(key_tiles, "local_memory", stand_in)
    return probe


@pytest.fixture
def launches(monkeypatch):
    """The engine's forward launches, not run: per launch (config, the tile shapes whose
    tables were built by then)."""
    seen = []

    def record(spec, q, k, v, out, lse, stream, config=None, extras=None, tiles=None,
               maps=None, multiprocessors=0):
        launched = hopper_forward_launch(spec, q, k, v, out, lse, config, extras, tiles, maps,
                                         multiprocessors)
        seen.append((launched[0], {key[1:3] for key in tiles.block_mask._tables}))
    monkeypatch.setattr(engine, "launch_hopper_forward", record)
    return seen


def _qkv(rng, head_dim, seqlen=40, nheads=2):
    return (rng.standard_normal((1, seqlen, nheads, head_dim)).astype(np.float16)
            for _ in range(3))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("local_bytes", [0, 8])
def test_a_mask_mod_forward_takes_128_keys_where_they_keep_no_local_memory(
        rng, local_memory, launches, head_dim, local_bytes):
    """The launch and its tile tables take the 128-key tiles where the probe reports no
    local memory for the call's kernel and argument types, else the mask_mod table's (each
    call on host arrays takes the full path, which asks)."""
    local_memory["reported"] = local_bytes
    q, k, v = _qkv(rng, head_dim)
    for _ in range(2):
        numba_flash.forward(q, k, v, causal=True, mask_mod=document_mask,
                            backend="numba-hopper")
    want = NARROW if local_bytes else WIDE[head_dim]
    assert launches == [(want, {(want.block_m, want.block_n)})] * 2
    assert len(local_memory["asked"]) == 2 and local_memory["asked"][0] == local_memory[
        "asked"][1]
    kernel, _, device = local_memory["asked"][0]
    assert kernel.py_func.__name__ == "flash_forward_hopper" and device == 0
    # another kernel (softcap), another question
    numba_flash.forward(q, k, v, causal=True, softcap=20.0, mask_mod=document_mask,
                        backend="numba-hopper")
    assert len(local_memory["asked"]) == 3 and local_memory["asked"][2][0] is not kernel


def test_a_varlen_mask_mod_forward_takes_two_consumers_on_128_keys(rng, local_memory,
                                                                   launches):
    """varlen's wide tiles at d64 are two consumers' (three spilled holding a sequence's
    bounds: config.py)."""
    q, k, v = (x[0] for x in _qkv(rng, 64, seqlen=90))
    cu = np.array([0, 50, 90], np.int32)
    numba_flash.forward_varlen(q, k, v, cu, cu, 50, 50, causal=True, mask_mod=gapped_mask,
                               backend="numba-hopper")
    assert launches[0][0] == HopperConfig(128)


def test_the_simulator_keeps_the_mask_mod_tables_tiles(rng, launches):
    """Left alone, the probe compiles nothing under the simulator: 64-key tiles, as the
    mask_mod table says."""
    q, k, v = _qkv(rng, 128)
    numba_flash.forward(q, k, v, causal=True, mask_mod=document_mask, backend="numba-hopper")
    assert launches[0][0] == NARROW


# (document_mask's documents cover 80 tokens; gapped_mask takes any length: two key tiles)
@pytest.mark.parametrize("head_dim, seqlen_k, group, options", [
    (64, 80, 2, dict(causal=True, mask_mod=document_mask)),
    (128, 150, 1, dict(softcap=20.0, mask_mod=gapped_mask))])
def test_a_mask_mod_forward_on_128_key_tiles_is_right(rng, local_memory, head_dim, seqlen_k,
                                                      group, options):
    """The whole forward on the tiles chosen (tables and kernel at 128 keys; d64's 192-row
    query tiles of three consumers), against the float64 reference."""
    q = rng.standard_normal((1, 70, 2, head_dim)).astype(np.float16)
    k, v = (rng.standard_normal((1, seqlen_k, 2 // group, head_dim)).astype(np.float16)
            for _ in range(2))
    out, lse = numba_flash.forward(q, k, v, backend="numba-hopper", **options)
    want_out, want_lse = numba_flash.forward(q, k, v, backend="numpy", **options)
    assert len(local_memory["asked"]) == 1
    np.testing.assert_allclose(out.astype(np.float64), want_out, atol=3e-3)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-4)


@pytest.mark.parametrize("along_keys", [False, True])
def test_the_tile_tables_stand_ins_have_their_shapes_and_types(rng, along_keys):
    """What the choice compiles for before the tables are built: their shapes (the call's
    batch and heads; key spans per key/value head) and element types."""
    spec = AttentionSpec(64, "float16", causal=True, mask_mod=document_mask, group=2)
    q = np.zeros((2, 70, 4, 64), np.uint16)
    k = np.zeros((2, 80, 2, 64), np.uint16)
    tables = Layout(rng, spec, (2, 70, 80, 4, 64), None, document_mask).tiles(
        spec, q, k, np.zeros((2, 4, 70), np.float32))
    for block_m, block_n in ((128, 64), (192, 128)):
        built = tables.arguments(block_m, block_n, along_keys)
        stand_ins = tables.stand_ins().arguments(block_m, block_n, along_keys)
        assert [(x.shape, x.dtype) for x in stand_ins[:2]] == \
            [(x.shape, x.dtype) for x in built[:2]]
        assert stand_ins[2] is built[2]  # (mask_mod's captured arrays)
