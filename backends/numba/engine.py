"""The engine contract: one kernel family of the Numba backends.

The backend (backend.py) tries its engines in order and runs the first whose `reason` is None;
a new family is a new Engine in a new package, added to the backends' `engines` tuples.
Engines receive the outputs (and the backward's delta scratch) allocated, an `alloc(shape,
dtype)` for any further array (copies, scratch: of the call's library and device, noted for
replays), the stream handle to launch on, and the call's numba_flash.extras.Extras (ALiBi
slopes, cu_seqlens). Varlen arrays come with a batch axis of one (device/sequence.py).
"""


class Engine:
    name = ""

    def reason(self, spec, q, k, v):
        """None if this engine's kernels can run the call, else a sentence saying why not."""
        raise NotImplementedError

    def forward(self, spec, q, k, v, out, lse, alloc, stream, extras):
        """Fill out (like q) and lse (float32 (batch, nheads, seqlen_q))."""
        raise NotImplementedError

    def backward(self, spec, dout, q, k, v, out, lse, delta, grads, alloc, stream, extras):
        """Fill grads = (dq, dk, dv); delta is float32 (batch, nheads, seqlen_q) scratch."""
        raise NotImplementedError

    def __repr__(self):
        return f"<numba_flash engine {self.name!r}>"
