"""Repeated calls with a mask_mod (numba_flash/call_cache.py, backends/numba/replay.py): the
arrays mask_mod captures are part of the signature and read anew by each replay; a block
mask's calls are kept in the block mask and launch with its tile tables (constants of the
replay), which are built once and not rebuilt by a replay; without a block mask a replay
classifies the tiles again, from the call's own captured values."""
import gc
import weakref

import numpy as np
import pytest
from error_rule import assert_within_rule

import numba_flash
from numba_flash import _checks, call_cache
from numba_flash.backends.numba import replay as numba_replay
from numba_flash.extras import Extras
from numba_flash.mask_mod import lower
from numba_flash.reference import attention_forward
from numba_flash.spec import make_spec

SEQLEN, NHEADS, HEAD_DIM = 12, 2, 8


def _documents(rng, xp=np, length=SEQLEN):
    """Random document ids (each document 1 to 5 tokens long)."""
    lengths = rng.integers(1, 6, length)
    return xp.asarray(np.repeat(np.arange(length), lengths)[:length], xp.int32)


def _same_document(ids):
    """A new closure of one code over `ids` (a training loop's mask_mod, step after step)."""
    def same_document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    return same_document


def _qkv(rng):
    return [rng.standard_normal((1, SEQLEN, NHEADS, HEAD_DIM)) for _ in range(3)]


def _reference(q, k, v, mask_mod):
    program, captured = lower(mask_mod)
    spec = make_spec(q, k, causal=True, mask_mod=program)
    return attention_forward(np, q, k, v, spec, np.float64, Extras(mask_mod_arrays=captured))


@pytest.fixture
def counted_checks(monkeypatch):
    """How often the full path checked q, k and v."""
    count = [0]
    real = _checks.check_qkv
    monkeypatch.setattr(_checks, "check_qkv", lambda *a: count.append(1) or real(*a))
    return count


# -- CPU ----------------------------------------------------------------------------------------

def test_a_replay_reads_the_captured_arrays_of_its_call(rng, host_replays, counted_checks):
    for step in range(3):
        mask_mod = _same_document(_documents(rng))  # new ids, same code and shape
        q, k, v = _qkv(rng)
        out, lse = numba_flash.forward(q, k, v, causal=True, mask_mod=mask_mod, backend="numpy")
        want_out, want_lse = _reference(q, k, v, mask_mod)
        np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-6)  # (float32)
    assert len(counted_checks) == 2  # the first step only: the others were replays
    other_shape = _same_document(_documents(rng, length=SEQLEN + 1))
    numba_flash.forward(q, k, v, causal=True, mask_mod=other_shape, backend="numpy")
    assert len(counted_checks) == 3  # another signature


def test_a_block_masks_replays_live_in_it_and_go_with_it(rng, host_replays, counted_checks):
    mask_mod = _same_document(_documents(rng))
    blocks = numba_flash.block_mask(mask_mod, None, None, SEQLEN, SEQLEN)
    for _ in range(2):
        q, k, v = _qkv(rng)
        out, _ = numba_flash.forward(q, k, v, causal=True, block_mask=blocks, backend="numpy")
        np.testing.assert_allclose(out, _reference(q, k, v, mask_mod)[0], rtol=0, atol=1e-12)
    assert len(counted_checks) == 2 and len(blocks.replays) == 1
    assert not call_cache._replays  # (kept in the block mask, not beside the others)
    call_cache.clear()
    assert not blocks.replays
    numba_flash.forward(q, k, v, causal=True, block_mask=blocks, backend="numpy")
    gone = weakref.ref(blocks)
    gc.disable()  # (its replays hold it weakly: it goes with its last reference)
    try:
        del blocks
        assert gone() is None
    finally:
        gc.enable()


def test_a_block_mask_keeps_a_few_signatures(rng, host_replays, monkeypatch):
    monkeypatch.setattr(call_cache, "MAX_BLOCK_MASK_ENTRIES", 2)
    blocks = numba_flash.block_mask(_same_document(_documents(rng)), None, None, SEQLEN, SEQLEN)
    q, k, v = _qkv(rng)
    for scale in (0.1, 0.2, 0.3):
        numba_flash.forward(q, k, v, softmax_scale=scale, block_mask=blocks, backend="numpy")
    assert [key[2].softmax_scale for key in blocks.replays] == [0.2, 0.3]


def test_a_replay_launches_with_its_constants_at_their_addresses():
    from test_call_cache import FakeBackend, FakeDeviceArray, FakeLaunch
    backend, launched = FakeBackend(), FakeLaunch()
    q, table = FakeDeviceArray(), FakeDeviceArray()
    with numba_replay.recording() as record:
        out = backend._new(q, (2,), "float32")
        numba_replay.note_constant(table)
        numba_replay.note_constant(table)  # (two kernels' arguments: one constant)
        numba_replay.note_launch(launched, [q.ptr, table.ptr, out.ptr])
    replay = numba_replay.build_replay(backend, record, (q,), (out,))
    assert replay.constants == (table,)
    new_q = FakeDeviceArray()
    new_out, = replay(new_q)
    assert launched.calls[-1][1] == [new_q.ptr, table.ptr, new_out.ptr]
    with numba_replay.recording() as record:  # a constant at an input's address: ambiguous
        numba_replay.note_constant(q)
        numba_replay.note_launch(launched, [q.ptr])
    assert numba_replay.build_replay(backend, record, (q,), ()) is None


@pytest.mark.parametrize("kept", [True, False], ids=["block-mask", "own-tables"])
def test_a_block_masks_tables_are_constants_of_the_call_and_a_calls_own_allocations(rng, kept):
    """What a call records of its tile tables: a block mask's are constants (built outside
    the record, once); a call's own are allocations (a replay builds them again)."""
    from numba_flash.backends.numba.tile_classes import TileTables
    ids = _documents(rng)
    program, captured = lower(_same_document(ids))
    spec = make_spec(np.zeros((1, SEQLEN, NHEADS, HEAD_DIM)), causal=True, mask_mod=program)
    blocks = numba_flash.block_mask(_same_document(ids), None, None, SEQLEN, SEQLEN)

    def alloc(shape, dtype):
        array = np.full(shape, 77, dtype)
        numba_replay.note_allocation(shape, dtype, array)
        return array
    tables = TileTables(spec, blocks if kept else None, (1, NHEADS, SEQLEN, SEQLEN), alloc, 0,
                        0, captured)
    allocated = []
    for _ in range(2):  # (the second kernel of a call with the same tile shape)
        with numba_replay.recording() as record:
            classes, spans, _ = tables.arguments(4, 4, along_keys=False)
        assert (classes != 77).all() and (spans != 77).all()
        allocated.append([dtype for _, dtype, _ in record.allocations])
        if kept:
            built_classes, query_spans, _, _ = next(iter(blocks._tables.values()))
            assert [x is y for x, y in zip(record.constants, (built_classes, query_spans))] == [
                True, True]
        else:
            assert not record.constants
    assert allocated == ([[], []] if kept else [["int8", "int32", "int32"], []])


# -- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("backend, dtype", [("numba", "float16"), ("numba-mma", "float16"),
                                            ("numba-simt", "float32")])
def test_mask_mod_calls_replay_with_a_block_mask_and_without(cp, rng, poisoned_outputs,
                                                             monkeypatch, backend, dtype):
    """Three steps of a training loop's forward and backward, with one block mask and with a
    new closure over new document ids each step: the later steps are replays (the backend's
    Python is not entered), their outputs are attention under the step's own documents, and
    bitwise the full path's on the same inputs."""
    from numba_flash.backends.numba.backend import NumbaBackend
    batch, seqlen, nheads, head_dim = 2, 700, 4, 64
    ids = _documents(rng, cp, seqlen) // 40  # (documents of about 120 tokens)
    blocks = numba_flash.block_mask(_same_document(ids), None, None, seqlen, seqlen)
    full_path = {"forward": NumbaBackend.forward, "backward": NumbaBackend.backward}
    for kind in ("block_mask", "mask_mod"):
        for step in range(3):
            if kind == "block_mask":
                mask_mod, options = blocks.mask_mod, dict(block_mask=blocks)
            else:
                mask_mod = _same_document(_documents(rng, cp, seqlen) // 40)
                options = dict(mask_mod=mask_mod)
            q, k, v, dout = (cp.asarray(rng.standard_normal((batch, seqlen, nheads, head_dim)),
                                        dtype) for _ in range(4))
            if step:
                for name in full_path:
                    monkeypatch.setattr(NumbaBackend, name, None)  # a replay never calls them
            out, lse = numba_flash.forward(q, k, v, causal=True, backend=backend, **options)
            grads = numba_flash.backward(dout, q, k, v, out, lse, causal=True, backend=backend,
                                         **options)
            for name, method in full_path.items():
                monkeypatch.setattr(NumbaBackend, name, method)
            program, captured = lower(mask_mod)
            spec = make_spec(q, k, causal=True, mask_mod=program)
            extras = Extras(mask_mod_arrays=captured)
            ref_out, _ = attention_forward(cp, q, k, v, spec, "float64", extras)
            base_out, _ = attention_forward(cp, q, k, v, spec, dtype, extras)
            assert_within_rule("out", out.get(), base_out.get(), ref_out.get(), dtype)
            call_cache.clear()
            again = numba_flash.forward(q, k, v, causal=True, backend=backend, **options)
            again += numba_flash.backward(dout, q, k, v, out, lse, causal=True,
                                          backend=backend, **options)
            for replayed, full in zip((out, lse, *grads), again):
                assert cp.array_equal(replayed, full, equal_nan=True), (kind, step)
            call_cache.clear()
            numba_flash.forward(q, k, v, causal=True, backend=backend, **options)
            numba_flash.backward(dout, q, k, v, out, lse, causal=True, backend=backend,
                                 **options)
        replays = blocks.replays.values() if kind == "block_mask" else call_cache._replays.values()
        assert [type(r) for r in replays] == [numba_replay.Replay] * 2, kind
