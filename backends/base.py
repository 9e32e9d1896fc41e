"""The backend contract: what every entry of the backend table provides.

Every method takes the call's AttentionSpec (numba_flash/spec.py) first. The public API has
already built the spec (options checked, softmax_scale resolved) and checked the arrays'
shapes, dtypes and placement (numba_flash/_checks.py) before it calls a backend, so backends
only decide whether they can serve a call (`supports`) and compute.

A backend may also say how to repeat a call cheaply (`forward_and_replay`,
`backward_and_replay`): numba_flash/call_cache.py keeps the replay per call signature.
"""
import functools


class Backend:
    """Base class for backends. Subclasses set `name` and `dtypes` and implement the methods."""

    name = ""
    #: dtype names this backend computes (for the error message of an unsupported dtype)
    dtypes = ()

    def supports(self, spec, q, k, v):
        """None if this backend can run the call, else a sentence saying why not."""
        raise NotImplementedError

    def forward(self, spec, q, k, v):
        """Return (out, lse): out like q, lse float32 (batch, nheads, seqlen_q), natural log."""
        raise NotImplementedError

    def backward(self, spec, dout, q, k, v, out, lse):
        """Return (dq, dk, dv), each with the shape and dtype of q, k, v."""
        raise NotImplementedError

    def forward_and_replay(self, spec, q, k, v):
        """(forward's result, replay): replay(q, k, v) repeats the call on new arrays of the
        same signature (spec, shapes, strides, dtypes, device, library, 16-byte alignment). By
        default it is forward itself; the public API's checks and backend choice, already
        made for that signature, are what a repeat skips."""
        return self.forward(spec, q, k, v), functools.partial(self.forward, spec)

    def backward_and_replay(self, spec, dout, q, k, v, out, lse):
        """(backward's result, replay of (dout, q, k, v, out, lse)), as forward_and_replay."""
        return (self.backward(spec, dout, q, k, v, out, lse),
                functools.partial(self.backward, spec))

    def __repr__(self):
        return f"<numba_flash backend {self.name!r}>"
