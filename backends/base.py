"""The backend contract: what every entry of the backend table provides.

The public API has already checked shapes, dtypes and placement (numba_flash._checks) and resolved
`softmax_scale` before it calls a backend, so backends only decide whether they can serve a call
(`supports`) and compute.

A backend may also say how to repeat a call cheaply (`forward_and_replay`,
`backward_and_replay`): numba_flash/call_cache.py keeps the replay per call signature.
"""
import functools


class Backend:
    """Base class for backends. Subclasses set `name` and `dtypes` and implement the methods."""

    name = ""
    #: dtype names this backend computes (for the error message of an unsupported dtype)
    dtypes = ()

    def supports(self, q, k, v, *, causal=False, softmax_scale=None):
        """None if this backend can run the call, else a sentence saying why not."""
        raise NotImplementedError

    def forward(self, q, k, v, *, causal, softmax_scale):
        """Return (out, lse): out like q, lse float32 (batch, nheads, seqlen_q), natural log."""
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale):
        """Return (dq, dk, dv), each with the shape and dtype of q, k, v."""
        raise NotImplementedError

    def forward_and_replay(self, q, k, v, *, causal, softmax_scale):
        """(forward's result, replay): replay(q, k, v) repeats the call on new arrays of the
        same signature (shapes, strides, dtypes, device, library, 16-byte alignment). By
        default it is forward itself; the public API's checks and backend choice, already
        made for that signature, are what a repeat skips."""
        options = dict(causal=causal, softmax_scale=softmax_scale)
        return self.forward(q, k, v, **options), functools.partial(self.forward, **options)

    def backward_and_replay(self, dout, q, k, v, out, lse, *, causal, softmax_scale):
        """(backward's result, replay of (dout, q, k, v, out, lse)), as forward_and_replay."""
        options = dict(causal=causal, softmax_scale=softmax_scale)
        return (self.backward(dout, q, k, v, out, lse, **options),
                functools.partial(self.backward, **options))

    def __repr__(self):
        return f"<numba_flash backend {self.name!r}>"
