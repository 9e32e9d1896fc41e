"""The backend contract: what every entry of the backend table provides.

Every method takes the call's AttentionSpec (numba_flash/spec.py) first, and the computing
ones the call's arrays besides q, k, v last (numba_flash.extras.Extras: ALiBi slopes, varlen's
cu_seqlens; NO_EXTRAS when it has none). The public API has
already built the spec (options checked, softmax_scale resolved) and checked the arrays'
shapes, dtypes and placement (numba_flash/_checks.py) before it calls a backend, so backends
only decide whether they can serve a call (`supports`) and compute.

A backend may also say how to repeat a call cheaply (`forward_and_replay`,
`backward_and_replay`): numba_flash/call_cache.py keeps the replay per call signature.
"""
import weakref

from numba_flash.extras import NO_EXTRAS

#: what a replay keeps in place of each array a call gives (with_arrays fills them in again):
#: a replay outlives its first call and must not keep that call's arrays (GPU memory) alive
_GIVEN = True


def _form(extras):
    """fill(arrays) -> extras with those arrays in place of its own. It holds the block mask
    weakly: the replay is kept in that block mask (numba_flash/call_cache.py), which must be
    able to go without a collector run."""
    form = extras.with_arrays((_GIVEN,) * len(extras.arrays()))
    if form.block_mask is None:
        return form.with_arrays
    block_mask = weakref.ref(form.block_mask)
    form = form._replace(block_mask=None)
    return lambda arrays: form.with_arrays(arrays)._replace(block_mask=block_mask())


class Backend:
    """Base class for backends. Subclasses set `name` and `dtypes` and implement the methods."""

    name = ""
    #: dtype names this backend computes (for the error message of an unsupported dtype)
    dtypes = ()

    def supports(self, spec, q, k, v):
        """None if this backend can run the call, else a sentence saying why not."""
        raise NotImplementedError

    def forward(self, spec, q, k, v, extras=NO_EXTRAS):
        """Return (out, lse): out like q, lse float32 (batch, nheads, seqlen_q), natural log
        ((nheads, total_q) for varlen)."""
        raise NotImplementedError

    def backward(self, spec, dout, q, k, v, out, lse, extras=NO_EXTRAS):
        """Return (dq, dk, dv), each with the shape and dtype of q, k, v."""
        raise NotImplementedError

    def supports_kvcache(self, spec, q, k_cache):
        """None if this backend can run numba_flash.forward_kvcache's call, else why not."""
        return "it has no KV-cache attention"

    def forward_kvcache(self, spec, q, cache, extras=NO_EXTRAS):
        """(out, lse) of numba_flash.forward_kvcache: cache is its numba_flash.kvcache.KVCache
        (new tokens appended in place first)."""
        raise NotImplementedError

    def forward_kvcache_and_replay(self, spec, q, cache, extras=NO_EXTRAS):
        """(forward_kvcache's result, replay): replay(q, k_cache, v_cache, *cache.arrays(),
        *extras.arrays()) repeats the call on new arrays of the same signature, whose values
        the public API has checked. By default it is forward_kvcache itself."""
        given = len(cache.arrays())
        cache_form = cache.with_arrays(None, None, (_GIVEN,) * given)
        fill_extras = _form(extras)

        def replay(q, k_cache, v_cache, *arrays):
            return self.forward_kvcache(
                spec, q, cache_form.with_arrays(k_cache, v_cache, arrays[:given]),
                fill_extras(arrays[given:]))
        return self.forward_kvcache(spec, q, cache, extras), replay

    def forward_and_replay(self, spec, q, k, v, extras=NO_EXTRAS):
        """(forward's result, replay): replay(q, k, v, *extras.arrays()) repeats the call on
        new arrays of the same signature (spec, shapes, strides, dtypes, device, library,
        16-byte alignment). By default it is forward itself; the public API's checks and
        backend choice, already made for that signature, are what a repeat skips."""
        fill_extras = _form(extras)

        def replay(q, k, v, *extra_arrays):
            return self.forward(spec, q, k, v, fill_extras(extra_arrays))
        return self.forward(spec, q, k, v, extras), replay

    def backward_and_replay(self, spec, dout, q, k, v, out, lse, extras=NO_EXTRAS):
        """(backward's result, replay of (dout, q, k, v, out, lse, *extras.arrays())), as
        forward_and_replay."""
        fill_extras = _form(extras)

        def replay(dout, q, k, v, out, lse, *extra_arrays):
            return self.backward(spec, dout, q, k, v, out, lse,
                                 fill_extras(extra_arrays))
        return self.backward(spec, dout, q, k, v, out, lse, extras), replay

    def __repr__(self):
        return f"<numba_flash backend {self.name!r}>"
