"""The Numba backends: FlashAttention kernels written as Numba CUDA kernels.

Each backend holds engines, one per kernel family, in order of preference, and runs a call on
the first engine whose `reason(spec, q, k, v)` is None:
  - "numba": the Hopper engine (hopper/: wgmma, float16 and bfloat16 on compute capability
    9.0; the backward of head dims above 128 on the tensor-core engine's kernels; calls with
    an attn_mask or a mask_mod above head dim 128 not taken), else the
    tensor-core engine (mma/: float16 and bfloat16 on compute capability 8.0 or newer), else
    the SIMT engine (simt/: float32, float16, bfloat16 on sm_80 and newer);
  - "numba-hopper", "numba-mma", "numba-simt": one engine only (for comparisons, benchmarks
    and tests).
numba_flash.forward_kvcache runs on the split-KV decode kernels (decode/): on "numba" the
tensor-core one for float16 and bfloat16 on sm_80 and newer (SIMT under the simulator), else the
SIMT one; on "numba-mma" the tensor-core one, on "numba-simt" the SIMT one.

They take device arrays (CuPy, torch, Numba, anything with __cuda_array_interface__) and launch
on the caller's current stream. Under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, for
machines without a GPU) they take host arrays (NumPy, or CPU torch tensors for bfloat16)
instead; there "numba" uses SIMT only, and "numba-hopper" and "numba-mma" run their kernels
through the intrinsics' Python twins. Numba is imported only when a backend is first used.
"""
import contextlib
import functools

from numba_flash import _arrays
from numba_flash.backends.base import Backend
from numba_flash.extras import NO_EXTRAS

from . import replay
from .decode.engine import DecodeEngine
from .gpu import simulator_enabled
from .hopper.engine import HopperEngine
from .launch import on_device
from .mma.engine import MmaEngine
from .simt.engine import SimtEngine
from .tile_classes import check_mask_mod


class NumbaBackend(Backend):
    name = "numba"
    dtypes = ("float16", "bfloat16", "float32")
    #: the engines this backend may use, in order of preference
    engines = (HopperEngine(backward_engine=MmaEngine()), MmaEngine(), SimtEngine())
    #: the KV-cache engine (decode/), or None
    decode = DecodeEngine()

    def available(self):
        """None if the kernels can run here (a CUDA GPU, or the simulator), else the reason."""
        if simulator_enabled():
            return None
        from numba import cuda
        if not cuda.is_available():
            return ("Numba found no usable CUDA GPU (set NUMBA_ENABLE_CUDASIM=1 before importing "
                    "numba to run the kernels in Numba's CUDA simulator)")
        return None

    def supports(self, spec, q, k, v):
        reason = self._takes(spec, q)
        return reason or self.engine(spec, q, k, v)[1]

    def supports_kvcache(self, spec, q, k_cache):
        if self.decode is None:
            return "it has no KV-cache kernels (the numba, numba-mma and numba-simt backends do)"
        return self._takes(spec, q) or self.decode.reason(spec, q, k_cache)

    def _takes(self, spec, q):
        """None if the kernels run here and take q's batch, dtype and kind of array."""
        reason = self.available()
        if reason:
            return reason
        if not spec.varlen and int(q.shape[0]) > MAX_SEQUENCES:
            return (f"its kernels' grid takes at most {MAX_SEQUENCES} sequences; got batch "
                    f"{q.shape[0]}")
        if spec.dtype not in self.dtypes:
            return f"dtype {spec.dtype} is not supported (it supports {', '.join(self.dtypes)})"
        kind = _arrays.array_kind(q)
        if simulator_enabled():
            if kind != _arrays.HOST:
                return "under the CUDA simulator it takes host (NumPy) arrays only"
        elif not _arrays.is_device_kind(kind):
            return ("it runs on the GPU and takes device arrays (CuPy, torch, Numba); got host "
                    "arrays: copy them to the GPU first, e.g. cupy.asarray(q)")
        return None

    def engine(self, spec, q, k, v):
        """(engine, None) for the first engine that can run the call, else (None, reasons)."""
        reasons = []
        for engine in self.engines:
            reason = engine.reason(spec, q, k, v)
            if reason is None:
                return engine, None
            reasons.append(reason)
        return None, "; ".join(reasons)

    def _engine_or_raise(self, spec, q, k, v):
        engine, reason = self.engine(spec, q, k, v)
        if engine is None:
            raise ValueError(f"backend {self.name!r} cannot run this call: {reason}")
        return engine

    # -- what a replay repeats per call (replay.Replay) -----------------------------------------

    def _stream(self, ref):
        """The caller's current stream for a launch, as a handle (0 under the simulator)."""
        if simulator_enabled():
            return 0
        handle = _arrays.caller_stream_handle(ref)
        return 1 if handle is None else handle  # None: the legacy default stream

    def _on_device(self, ref):
        """The arrays' GPU made current for the allocations and launches."""
        if simulator_enabled():
            return contextlib.nullcontext()
        return on_device(_arrays.device_id(ref))

    def _new(self, ref, shape, dtype):
        """A new C-contiguous array of ref's library and device (outputs and scratch)."""
        array = _arrays.empty_like_kind(ref, shape, dtype)
        replay.note_allocation(shape, dtype, array)
        return array

    # -- calls -----------------------------------------------------------------------------------

    def forward_and_replay(self, spec, q, k, v, extras=NO_EXTRAS):
        inputs = (q, k, v, *extras.arrays())
        with replay.recording() as record:
            result, fallback = super().forward_and_replay(spec, q, k, v, extras)
        return result, replay.build_replay(self, record, inputs, result) or fallback

    def backward_and_replay(self, spec, dout, q, k, v, out, lse, extras=NO_EXTRAS):
        inputs = (dout, q, k, v, out, lse, *extras.arrays())
        with replay.recording() as record:
            result, fallback = super().backward_and_replay(spec, dout, q, k, v, out, lse, extras)
        return result, replay.build_replay(self, record, inputs, result, ref=1) or fallback  # q

    def forward_kvcache_and_replay(self, spec, q, cache, extras=NO_EXTRAS):
        inputs = (q, cache.k_cache, cache.v_cache, *cache.arrays(), *extras.arrays())
        with replay.recording() as record:
            result, fallback = super().forward_kvcache_and_replay(spec, q, cache, extras)
        return result, replay.build_replay(self, record, inputs, result) or fallback

    def forward(self, spec, q, k, v, extras=NO_EXTRAS):
        engine = self._engine_or_raise(spec, q, k, v)
        _check_sequences(spec, extras)
        if spec.mask_mod is not None:
            check_mask_mod(spec.mask_mod, extras.mask_mod_arrays)
        nheads, seqlen_q = int(q.shape[-2]), int(q.shape[-3])
        lse_shape = (nheads, seqlen_q) if spec.varlen else (int(q.shape[0]), nheads, seqlen_q)
        with self._on_device(q):
            out = self._new(q, tuple(int(s) for s in q.shape), spec.dtype)
            lse = self._new(q, lse_shape, "float32")
            arrays = _batched(spec, (q, k, v, out, lse))
            engine.forward(spec, *arrays, functools.partial(self._new, q), self._stream(q),
                           extras)
        return out, lse

    def forward_kvcache(self, spec, q, cache, extras=NO_EXTRAS):
        batch, seqlen_q, nheads, _ = (int(s) for s in q.shape)
        with self._on_device(q):
            out = self._new(q, (batch, seqlen_q, nheads, spec.head_dim), spec.dtype)
            lse = self._new(q, (batch, nheads, seqlen_q), "float32")
            self.decode.forward_kvcache(spec, q, cache, out, lse, functools.partial(self._new, q),
                                        self._stream(q), extras)
        return out, lse

    def backward(self, spec, dout, q, k, v, out, lse, extras=NO_EXTRAS):
        engine = self._engine_or_raise(spec, q, k, v)
        _check_sequences(spec, extras)
        if spec.mask_mod is not None:
            check_mask_mod(spec.mask_mod, extras.mask_mod_arrays)
        with self._on_device(q):
            grads = [self._new(q, tuple(int(s) for s in x.shape), spec.dtype) for x in (q, k, v)]
            dout, q, k, v, out, lse = _batched(spec, (dout, q, k, v, out, lse))
            delta = self._new(q, tuple(int(s) for s in lse.shape), "float32")
            engine.backward(spec, dout, q, k, v, out, lse, delta, _batched(spec, grads),
                            functools.partial(self._new, q), self._stream(q), extras)
        return tuple(grads)


#: sequences per call (grid.z of every kernel)
MAX_SEQUENCES = 65535


def _check_sequences(spec, extras):
    """varlen's batch within the kernels' grid (a plain batch is `supports`' to check)."""
    if spec.varlen and int(extras.cu_seqlens_q.shape[0]) - 1 > MAX_SEQUENCES:
        raise ValueError(f"the Numba kernels' grid takes at most {MAX_SEQUENCES} sequences; "
                         f"got cu_seqlens_q for {int(extras.cu_seqlens_q.shape[0]) - 1}")


def _batched(spec, arrays):
    """Varlen's packed arrays as the kernels see them, with a batch axis of one
    (device/sequence.py); other calls' arrays as they are."""
    if not spec.varlen:
        return tuple(arrays)
    return tuple(_arrays.with_batch_axis(x) for x in arrays)


class NumbaHopperBackend(NumbaBackend):
    name = "numba-hopper"
    dtypes = ("float16", "bfloat16")
    engines = (HopperEngine(backward_engine=MmaEngine(run_in_simulator=True),
                            run_in_simulator=True),)
    decode = None


class NumbaMmaBackend(NumbaBackend):
    name = "numba-mma"
    dtypes = ("float16", "bfloat16")
    engines = (MmaEngine(run_in_simulator=True),)
    decode = DecodeEngine("tensor-cores")


class NumbaSimtBackend(NumbaBackend):
    name = "numba-simt"
    dtypes = ("float16", "bfloat16", "float32")
    engines = (SimtEngine(),)
    decode = DecodeEngine("simt")
