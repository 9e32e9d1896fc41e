"""The backend contract: what every entry of the backend table provides.

The public API has already checked shapes, dtypes and placement (numba_flash._checks) and resolved
`softmax_scale` before it calls a backend, so backends only decide whether they can serve a call
(`supports`) and compute.
"""


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

    def __repr__(self):
        return f"<numba_flash backend {self.name!r}>"
