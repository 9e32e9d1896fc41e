"""Repeated calls (numba_flash/call_cache.py, backends/numba/replay.py): a signature seen before
skips the checks and the set-up, yet gives the same results, on the new arrays; bad input still
meets its error; the launch parameters are packed the way the kernels read them."""
import contextlib
import ctypes
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
from error_rule import assert_within_rule
from inputs import random_qkv

import numba_flash
from numba_flash import _checks, call_cache, registry
from numba_flash.backends.numba import launch as numba_launch, replay as numba_replay
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import make_spec


# -- CPU ----------------------------------------------------------------------------------------

def test_only_device_arrays_have_signatures_and_the_spec_is_part_of_them(rng, request):
    q, k, v = random_qkv(rng, 1, 5, 6, 2, 8, "float32")
    spec = make_spec(q, causal=True, softmax_scale=0.5)
    assert call_cache.signature("forward", "auto", spec, (q, k, v)) is None  # NumPy
    torch = pytest.importorskip("torch")
    assert call_cache.signature("forward", "auto", spec,
                                [torch.from_numpy(x) for x in (q, k, v)]) is None  # CPU torch
    request.getfixturevalue("host_replays")
    key = call_cache.signature("forward", "auto", spec, (q, k, v))
    assert key is not None and key[1] == ("auto", registry.default_backend()) and spec in key
    with numba_flash.use_backend("numpy"):  # "auto" stands for another default now
        assert call_cache.signature("forward", "auto", spec, (q, k, v)) != key
    for other in (make_spec(q, causal=False, softmax_scale=0.5), make_spec(q, causal=True)):
        assert call_cache.signature("forward", "auto", other, (q, k, v)) != key
    # the same options in another type make the same spec, hence the same signature
    assert make_spec(q, causal=True, softmax_scale=np.float32(0.5)) == spec
    assert call_cache.signature("forward", "auto", spec, (q, k[:, :, :, ::2], v)) != key
    # bad options never reach a signature: the spec refuses them
    for causal, scale in [(1, 0.5), (True, True), (True, "0.5")]:
        with pytest.raises(TypeError):
            make_spec(q, causal=causal, softmax_scale=scale)


def test_replays_can_be_turned_off(rng, monkeypatch, host_replays):
    q, k, v = random_qkv(rng, 1, 5, 6, 2, 8, "float32")
    spec = make_spec(q)
    assert call_cache.signature("forward", "auto", spec, (q, k, v)) is not None
    monkeypatch.setattr(call_cache, "ENABLED", False)
    assert call_cache.signature("forward", "auto", spec, (q, k, v)) is None


def test_the_environment_variable_turns_replays_off():
    code = "from numba_flash import call_cache; print(call_cache.ENABLED)"
    for value, expected in (("0", "False"), ("1", "True"), ("", "True")):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(os.environ, NUMBA_FLASH_REPLAY=value), check=True)
        assert run.stdout.strip() == expected, value


def test_repeated_calls_skip_the_checks_and_compute_on_the_new_arrays(rng, monkeypatch,
                                                                      host_replays):
    q, k, v = random_qkv(rng, 2, 7, 9, 2, 16, "float32")
    numba_flash.forward(q, k, v, causal=True, backend="numpy")
    checked = []
    real_check = _checks.check_qkv
    monkeypatch.setattr(_checks, "check_qkv", lambda *a: checked.append(1) or real_check(*a))
    q, k, v = random_qkv(rng, 2, 7, 9, 2, 16, "float32")  # same signature, new values
    out, lse = numba_flash.forward(q, k, v, causal=True, backend="numpy")
    assert not checked
    ref_out, ref_lse = attention_forward(np, q, k, v, make_spec(q, causal=True), np.float64)
    assert np.abs(out - ref_out).max() < 1e-5 and np.abs(lse - ref_lse).max() < 1e-5
    numba_flash.forward(q, k, v, causal=False, backend="numpy")  # another signature: checked
    assert checked == [1]
    with pytest.raises(ValueError, match="headdim mismatch: q has 16, v has 8"):
        numba_flash.forward(q, k, v[..., :8], causal=True, backend="numpy")


def test_a_failed_call_is_not_cached(rng, host_replays):
    q, k, v = random_qkv(rng, 1, 4, 4, 1, 8, "float32")
    for _ in range(2):
        with pytest.raises(ValueError, match="softmax_scale must be a finite positive number"):
            numba_flash.forward(q, k, v, softmax_scale=-1.0, backend="numpy")


def test_the_cache_keeps_the_newest_signatures(monkeypatch):
    monkeypatch.setattr(call_cache, "MAX_ENTRIES", 3)
    for i in range(5):
        call_cache.put(("key", i), i)
    assert [call_cache.get(("key", i)) for i in range(5)] == [None, None, 2, 3, 4]


def test_a_prepared_launch_packs_its_parameters_once(monkeypatch):
    launches = []
    monkeypatch.setattr(numba_launch, "_driver_launch", lambda *a: launches.append(a))
    parameters = [0, 0, 60, 2, 0x7000_1000, 3, 4, 5, 40, 10, 2, ctypes.c_float(0.375), -8]
    prepared = numba_launch.PreparedLaunch("kernel", (6, 2), (128,), 4096, parameters, [4])
    for pointer in (0x7100_0000, 0x7200_0040):
        prepared(7, [pointer])
        function, dims, shared_bytes, stream, kernel_params = launches[-1]
        assert (function, dims, shared_bytes, stream) == ("kernel", (6, 2, 1, 128, 1, 1), 4096, 7)
        addresses = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))
        read = [ctypes.c_int64.from_address(addresses[i]).value for i in range(len(parameters))]
        scale = ctypes.c_float.from_address(addresses[11]).value
        assert read[:4] + read[5:11] + read[12:] == parameters[:4] + parameters[5:11] + [-8]
        assert read[4] == pointer and scale == 0.375


class FakeDeviceArray:
    """An allocation known only by its address."""
    addresses = itertools.count(0x7000_0000, 0x1000)

    def __init__(self, shape=(1,), dtype="float32"):
        self.shape, self.dtype = shape, dtype
        self.__cuda_array_interface__ = {"data": (next(self.addresses), False)}

    @property
    def ptr(self):
        return self.__cuda_array_interface__["data"][0]


class FakeBackend:
    def __init__(self):
        self.devices = []

    def _new(self, ref, shape, dtype):
        array = FakeDeviceArray(shape, dtype)
        numba_replay.note_allocation(shape, dtype, array)
        return array

    def _stream(self, ref):
        return 0x5000

    def _on_device(self, ref):
        self.devices.append(ref)
        return contextlib.nullcontext()


class FakeLaunch:
    def __init__(self):
        self.calls = []

    def __call__(self, stream, pointers):
        self.calls.append((stream, pointers))


def _record_forward(backend, q, k, v, first, second):
    """What a backend's forward on (q, k, v) notes: two allocations, two launches."""
    with numba_replay.recording() as record:
        out, lse = backend._new(q, (2, 3), "float16"), backend._new(q, (2,), "float32")
        numba_replay.note_launch(first, [q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr])
        numba_replay.note_launch(second, [out.ptr, q.ptr])
    return record, (out, lse)


def test_a_replay_launches_on_the_new_calls_addresses():
    backend, first, second = FakeBackend(), FakeLaunch(), FakeLaunch()
    q, k, v = FakeDeviceArray(), FakeDeviceArray(), FakeDeviceArray()
    record, result = _record_forward(backend, q, k, v, first, second)
    replay = numba_replay.build_replay(backend, record, (q, k, v), result)
    new = FakeDeviceArray(), FakeDeviceArray(), FakeDeviceArray()
    out, lse = replay(*new)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((2, 3), "float16", (2,), "float32")
    assert out.ptr not in (result[0].ptr, result[1].ptr)
    assert first.calls[-1] == (0x5000, [x.ptr for x in (*new, out, lse)])
    assert second.calls[-1] == (0x5000, [out.ptr, new[0].ptr])
    assert backend.devices == [new[0]]
    q2, _, v2 = new  # aliased inputs at replay time: each role reads its own argument
    replay(q2, q2, v2)
    assert first.calls[-1][1][:3] == [q2.ptr, q2.ptr, v2.ptr]


def test_a_replay_takes_device_and_stream_from_its_reference_input():
    """A backward's reference is q (its second input), as in NumbaBackend.backward: dout may
    come from another library, whose stream is not the caller's."""
    backend = FakeBackend()
    dout, q = FakeDeviceArray(), FakeDeviceArray()
    with numba_replay.recording() as record:
        grad = backend._new(q, (2,), "float16")
        numba_replay.note_launch(FakeLaunch(), [dout.ptr, q.ptr, grad.ptr])
    replay = numba_replay.build_replay(backend, record, (dout, q), (grad,), ref=1)
    new_dout, new_q = FakeDeviceArray(), FakeDeviceArray()
    replay(new_dout, new_q)
    assert backend.devices == [new_q]


def test_one_object_passed_twice_replays_as_one_array():
    """(varlen's cu_seqlens for self-attention, attention(x, x, x)): both roles read the one
    argument's new address."""
    backend, first = FakeBackend(), FakeLaunch()
    q, v = FakeDeviceArray(), FakeDeviceArray()
    record, result = _record_forward(backend, q, q, v, first, FakeLaunch())  # q is k
    replay = numba_replay.build_replay(backend, record, (q, q, v), result)
    x, y = FakeDeviceArray(), FakeDeviceArray()
    out, lse = replay(x, x, y)
    assert first.calls[-1][1] == [x.ptr, x.ptr, y.ptr, out.ptr, lse.ptr]


def test_the_signature_tells_shared_addresses_from_distinct_ones(rng, host_replays):
    """A replay recorded on inputs at one address reads one address for both: it must not
    serve a call whose inputs lie apart (nor the other way round: each gets its own). One
    object passed twice and two views of one buffer share an address alike."""
    q, k, v = random_qkv(rng, 1, 5, 5, 2, 8, "float32")
    spec = make_spec(q)
    distinct = call_cache.signature("forward", "auto", spec, (q, k, v))
    twice = call_cache.signature("forward", "auto", spec, (q, q, v))
    assert None not in (distinct, twice) and distinct != twice
    assert call_cache.signature("forward", "auto", spec, (q, q, v)) == twice
    assert call_cache.signature("forward", "auto", spec, (k, k, v)) == twice
    assert call_cache.signature("forward", "auto", spec, (k, k[...], v)) == twice
    assert call_cache.signature("forward", "auto", spec, (q, k, q)) not in (distinct, twice)


def test_two_inputs_at_one_address_replay_as_one_array():
    """(k = q.detach(): two objects, one address) as one object passed twice."""
    backend, first = FakeBackend(), FakeLaunch()
    q, k, v = FakeDeviceArray(), FakeDeviceArray(), FakeDeviceArray()
    k.__cuda_array_interface__ = dict(q.__cuda_array_interface__)
    record, result = _record_forward(backend, q, k, v, first, FakeLaunch())
    replay = numba_replay.build_replay(backend, record, (q, k, v), result)
    x, y = FakeDeviceArray(), FakeDeviceArray()
    out, lse = replay(x, x, y)
    assert first.calls[-1][1] == [x.ptr, x.ptr, y.ptr, out.ptr, lse.ptr]


def test_no_replay_where_an_address_names_no_array_or_two():
    backend = FakeBackend()
    q, k, v = FakeDeviceArray(), FakeDeviceArray(), FakeDeviceArray()
    with numba_replay.recording() as record:  # an allocation at an input's address
        out = backend._new(q, (2,), "float32")
        out.__cuda_array_interface__ = dict(q.__cuda_array_interface__)
        numba_replay.note_launch(FakeLaunch(), [q.ptr, v.ptr])
    assert numba_replay.build_replay(backend, record, (q, q, v), (out,)) is None
    k = FakeDeviceArray()
    with numba_replay.recording() as record:
        out = backend._new(q, (2,), "float32")
        numba_replay.note_launch(FakeLaunch(), [q.ptr + 2, out.ptr])  # a view at an offset
    assert numba_replay.build_replay(backend, record, (q, k, v), (out,)) is None
    with numba_replay.recording() as record:  # nothing launched (the simulator)
        out = backend._new(q, (2,), "float32")
    assert numba_replay.build_replay(backend, record, (q, k, v), (out,)) is None


def test_recordings_nest_and_end():
    with numba_replay.recording() as outer:
        numba_replay.note_launch("a", [])
        with numba_replay.recording() as inner:
            numba_replay.note_launch("b", [])
        numba_replay.note_launch("c", [])
    numba_replay.note_launch("d", [])
    assert [p for p, _ in outer.launches] == ["a", "c"]
    assert [p for p, _ in inner.launches] == ["b"]


# -- GPU ----------------------------------------------------------------------------------------

def _device_inputs(cp, rng, shape, dtype):
    batch, seqlen_q, seqlen_k, nheads, headdim = shape
    return [cp.asarray(rng.standard_normal((batch, n, nheads, headdim)).astype(dtype))
            for n in (seqlen_q, seqlen_k, seqlen_k, seqlen_q)]


def _check_against_reference(cp, q, k, v, dout, out, lse, grads, causal, dtype):
    spec = make_spec(q, causal=causal)
    ref_out, ref_lse = attention_forward(cp, q, k, v, spec, "float64")
    base_out, base_lse = attention_forward(cp, q, k, v, spec, dtype)
    assert_within_rule("out", out.get(), base_out.get(), ref_out.get(), dtype)
    assert_within_rule("lse", lse.get(), base_lse.get(), ref_lse.get(), dtype)
    refs = attention_backward(cp, dout, q, k, v, out, lse, spec, "float64")
    bases = attention_backward(cp, dout, q, k, v, out, lse, spec, dtype)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, got.get(), base.get(), ref.get(), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, headdim", [("float16", 64), ("float16", 72), ("float32", 64)],
                         ids=["tensor-cores", "tensor-cores-padded", "simt"])
@pytest.mark.parametrize("causal", [False, True])
def test_repeated_calls_replay_the_launches(cp, rng, poisoned_outputs, monkeypatch, dtype,
                                            headdim, causal):
    """The second and third calls of a signature run as replays (the backend's Python is not
    entered), on fresh inputs, poisoned outputs: reference results, and bitwise the results of
    the full path on the same inputs."""
    from numba_flash.backends.numba.backend import NumbaBackend
    shape = (2, 333, 517, 3, headdim)
    q, k, v, dout = _device_inputs(cp, rng, shape, dtype)
    out, lse = numba_flash.forward(q, k, v, causal=causal, backend="numba")
    numba_flash.backward(dout, q, k, v, out, lse, causal=causal, backend="numba")
    for operation, arrays in (("forward", (q, k, v)), ("backward", (dout, q, k, v, out, lse))):
        key = call_cache.signature(operation, "numba", make_spec(q, causal=causal), arrays)
        assert isinstance(call_cache.get(key), numba_replay.Replay), operation
    full_path = {"forward": NumbaBackend.forward, "backward": NumbaBackend.backward}
    for _ in range(2):
        q, k, v, dout = _device_inputs(cp, rng, shape, dtype)
        for name in full_path:
            monkeypatch.setattr(NumbaBackend, name, None)  # a replay never calls them
        out, lse = numba_flash.forward(q, k, v, causal=causal, backend="numba")
        grads = numba_flash.backward(dout, q, k, v, out, lse, causal=causal, backend="numba")
        _check_against_reference(cp, q, k, v, dout, out, lse, grads, causal, dtype)
        for name, method in full_path.items():
            monkeypatch.setattr(NumbaBackend, name, method)
        call_cache.clear()
        again = numba_flash.forward(q, k, v, causal=causal, backend="numba")
        again += numba_flash.backward(dout, q, k, v, out, lse, causal=causal, backend="numba")
        for replayed, full in zip((out, lse, *grads), again):
            assert cp.array_equal(replayed, full, equal_nan=True)


@pytest.mark.gpu
def test_replays_follow_the_alignment_of_the_addresses(cp, rng):
    """Views with the same strides, rows 16-byte aligned (read in place) or not (copied first):
    two signatures, each replayed correctly."""
    batch, seqlen, nheads, headdim = 1, 300, 2, 64
    for _ in range(2):
        for start in (0, 1, 0, 1):
            packed = cp.asarray(rng.standard_normal((batch, seqlen, nheads, 3, headdim + 8)),
                                cp.float16)
            q, k, v = (packed[:, :, :, i, start:start + headdim] for i in range(3))
            dout = cp.asarray(rng.standard_normal(q.shape), cp.float16)
            out, lse = numba_flash.forward(q, k, v, causal=True, backend="numba")
            grads = numba_flash.backward(dout, q, k, v, out, lse, causal=True, backend="numba")
            _check_against_reference(cp, q, k, v, dout, out, lse, grads, True, "float16")
    aligned = call_cache.signature("forward", "numba", make_spec(q, causal=True), (q, k, v))
    assert isinstance(call_cache.get(aligned), numba_replay.Replay)


@pytest.mark.gpu
def test_a_replay_runs_on_the_stream_current_at_its_call(cp, rng, launch_streams):
    shape = (1, 300, 300, 2, 64)
    q, k, v, _ = _device_inputs(cp, rng, shape, "float16")
    first, _ = numba_flash.forward(q, k, v, backend="numba")  # recorded on the default stream
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        q2 = q * 2  # queued on `stream`: the replay must run after it
        out, _ = numba_flash.forward(q2, k, v, backend="numba")
        later = out * 1
    stream.synchronize()
    assert launch_streams[-1] == stream.ptr
    ref, _ = attention_forward(cp, q2, k, v, make_spec(q2), "float64")
    assert float(cp.abs(later.astype(cp.float64) - ref).max()) < 1e-3


@pytest.mark.gpu
def test_a_replayed_backward_follows_q_not_dout(cp, rng, launch_streams):
    """dout from CuPy, the rest torch tensors on a torch side stream: the replay launches on
    torch's stream and returns torch tensors, as the full path does."""
    torch = pytest.importorskip("torch")
    values = _device_inputs(cp, rng, (1, 300, 300, 2, 64), "float16")
    q, k, v = (torch.from_dlpack(x) for x in values[:3])
    dout = values[3]
    out, lse = numba_flash.forward(q, k, v, backend="numba")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grads = [numba_flash.backward(dout, q, k, v, out, lse, backend="numba")
                 for _ in range(2)]  # the full path, then a replay
    stream.synchronize()
    key = call_cache.signature("backward", "numba", make_spec(q), (dout, q, k, v, out, lse))
    assert isinstance(call_cache.get(key), numba_replay.Replay)
    assert launch_streams[-6:] == [stream.cuda_stream] * 6
    assert all(isinstance(g, torch.Tensor) for g in grads[1])
    for full, replayed in zip(*grads):
        assert torch.equal(full, replayed)


@pytest.mark.gpu
def test_inputs_at_one_address_replay_on_gpu(cp, rng):
    """q, k, v one array (then three views of one array, k = q.detach()'s case): calls on
    them get a replay of their own, which reads one address for all three; calls on distinct
    arrays of the same shapes after them get theirs, which the first calls left alone. Each
    result by the accuracy rule."""
    shape = (1, 200, 200, 2, 64)
    call_cache.clear()
    keys, replays = [], []
    for step in range(4):
        q, k, v, dout = _device_inputs(cp, rng, shape, "float16")
        if step == 0:
            k = v = q
        elif step == 1:
            q, k, v = q[...], q[...], q[...]
        keys.append(call_cache.signature("forward", "numba", make_spec(q), (q, k, v)))
        out, lse = numba_flash.forward(q, k, v, backend="numba")
        grads = numba_flash.backward(dout, q, k, v, out, lse, backend="numba")
        _check_against_reference(cp, q, k, v, dout, out, lse, grads, False, "float16")
        replays.append(call_cache.get(keys[-1]))
    # the views' call replayed the one-object call's recording; the distinct arrays got theirs
    assert keys[1] == keys[0] and replays[1] is replays[0]
    assert keys[2] == keys[3] != keys[0] and replays[3] is replays[2]
    spec = make_spec(q)
    for arrays in ((q, q, q), (q, k, v)):
        assert isinstance(call_cache.get(call_cache.signature("forward", "numba", spec, arrays)),
                          numba_replay.Replay)
        backward = (dout, *arrays, out, lse)
        assert isinstance(call_cache.get(call_cache.signature("backward", "numba", spec,
                                                              backward)), numba_replay.Replay)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["gpu", "host"])
def test_varlen_self_attention_replays(cp, rng, monkeypatch, where):
    """forward_varlen and backward_varlen given one cu_seqlens array for q and k (on the GPU,
    or on the host: copied once a call) are replayed, bit for bit as the full path."""
    lengths = np.array([300, 1, 517, 64], np.int32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu_seqlens = cp.asarray(cu) if where == "gpu" else cu

    def call(q, k, v, dout):
        varlen = (cu_seqlens, cu_seqlens, 517, 517)
        out, lse = numba_flash.forward_varlen(q, k, v, *varlen, causal=True, backend="numba")
        grads = numba_flash.backward_varlen(dout, q, k, v, out, lse, *varlen, causal=True,
                                            backend="numba")
        return [out, lse, *grads]

    call_cache.clear()
    for _ in range(3):
        arrays = [cp.asarray(rng.standard_normal((int(cu[-1]), 4, 64)), cp.float16)
                  for _ in range(4)]
        got = call(*arrays)
        monkeypatch.setattr(call_cache, "ENABLED", False)
        full = call(*arrays)
        monkeypatch.setattr(call_cache, "ENABLED", True)
        for a, b in zip(got, full):
            assert bool(cp.all(a == b)) and not bool(cp.isnan(a).any())
    assert sum(isinstance(r, numba_replay.Replay) for r in call_cache._replays.values()) == 2


@pytest.mark.gpu
def test_torch_bfloat16_calls_replay(cp, rng):
    """torch bfloat16 tensors (read through their addresses, no int16 views on a replay)."""
    torch = pytest.importorskip("torch")
    from numba_flash.testing import plain16_forward
    for _ in range(3):
        values = _device_inputs(cp, rng, (2, 257, 257, 2, 128), "float32")
        q, k, v = (torch.from_dlpack(x).to(torch.bfloat16) for x in values[:3])
        out, lse = numba_flash.forward(q, k, v, causal=True, backend="numba")
        assert out.dtype == torch.bfloat16
        exact = [cp.from_dlpack(x.float()) for x in (q, k, v)]
        ref_out, _ = attention_forward(cp, *exact, make_spec(exact[0], causal=True), "float64")
        base_out, _ = plain16_forward(cp, *exact, make_spec(exact[0], causal=True), "bfloat16")
        assert_within_rule("out", out.float().cpu().numpy(), base_out.get(), ref_out.get(),
                           "bfloat16")
    key = call_cache.signature("forward", "numba", make_spec(q, causal=True), (q, k, v))
    assert isinstance(call_cache.get(key), numba_replay.Replay)
