"""The tensor-core kernels' test cases, shared by tests/kernels/mma, tests/kernels/hopper and
tests/variants: 16-bit inputs as bit patterns, one launch into poisoned outputs, every result
checked against float64. `options` are AttentionSpec fields (window_left, window_right,
softcap, alibi, attn_mask: a random mask of that dtype, mask_mod: a function, whose tile
tables the case builds); kv_heads (GQA) gives k and v fewer heads than q; `lengths`
[(seqlen_q, seqlen_k) per sequence] makes the case varlen: the kernels see the sequences
packed along a batch axis of one (their view of forward_varlen's arrays), the references the
packed arrays themselves."""
import numpy as np
from error_rule import assert_within_rule

from numba_flash.extras import NO_EXTRAS, Extras
from numba_flash.mask_mod import lower

from numba_flash.backends.numba.mma.bwd import launch_mma_backward
from numba_flash.backends.numba.mma.fwd import launch_mma_forward
from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import AttentionSpec
from numba_flash.testing import bf16_bits, bf16_values, plain16_backward, plain16_forward

#: a quiet NaN both as float16 and as bfloat16 bits: what outputs are poisoned with
NAN16 = 0x7FC0


def encode(x, dtype):
    """(16-bit patterns, the float32 values they hold)."""
    if dtype == "float16":
        half = x.astype(np.float16)
        return half.view(np.uint16), half.astype(np.float32)
    bits = bf16_bits(np, x)
    return bits, bf16_values(np, bits)


def decode(bits, dtype):
    return bits.view(np.float16).astype(np.float32) if dtype == "float16" else bf16_values(np, bits)


def make_case_spec(shape, causal, dtype, kv_heads, options, lengths=None):
    """(spec, nheads of k and v) of a case."""
    nheads, head_dim = shape[3], shape[4]
    kv_heads = kv_heads or nheads
    if lengths is not None:
        options = dict(options, varlen=True, max_seqlen_q=max(n for n, _ in lengths),
                       max_seqlen_k=max(n for _, n in lengths))
    spec = AttentionSpec(head_dim, dtype, causal=causal, softmax_scale=head_dim ** -0.5,
                         group=nheads // kv_heads, **options)
    return spec, kv_heads


class Layout:
    """A case's array shapes and extras: (batch, seqlen_q, seqlen_k) arrays, or varlen's
    sequences packed into a batch of one. draw(n_side, nheads) gives the kernels' arrays;
    ref(x) the references' view of one (varlen: the packed array without its batch axis)."""

    def __init__(self, rng, spec, shape, lengths=None, mask_mod=None):
        batch, seqlen_q, seqlen_k, nheads, head_dim = shape
        self.rng, self.head_dim, self.varlen = rng, head_dim, lengths is not None
        if self.varlen:
            cu = [np.concatenate([[0], np.cumsum(side)]).astype(np.int32)
                  for side in zip(*lengths)]
            self.batch, self.rows, sequences = 1, (int(cu[0][-1]), int(cu[1][-1])), len(lengths)
        else:
            cu, self.batch, self.rows, sequences = (None, None), batch, (seqlen_q, seqlen_k), batch
        # ALiBi slopes per sequence and head for varlen, per head otherwise (the kernels'
        # view of those broadcasts them over the batch)
        slopes = (rng.uniform(0.05, 1.0, (sequences, nheads) if self.varlen else nheads)
                  .astype(np.float32) if spec.alibi else None)
        mask, self.mask_bits = self._mask(rng, spec.attn_mask, (batch, nheads) + self.rows)
        captured = lower(mask_mod)[1]  # (the arrays spec.mask_mod takes: mask_mod.py)
        self.extras = (Extras(slopes, *cu, mask, mask_mod_arrays=captured)
                       if spec.alibi or self.varlen or mask is not None or captured
                       else NO_EXTRAS)
        self.lse_shape = (self.batch, nheads, self.rows[0])

    @staticmethod
    def _mask(rng, dtype, shape):
        """(attn_mask of that dtype for the references, what the kernels take: bfloat16 as
        its bits), with random dimensions of 1 (broadcast), and a query row the mask hides
        every key from (a boolean mask's False, a float mask's -inf) where rows do not
        broadcast."""
        if dtype is None:
            return None, None
        shape = tuple(1 if rng.random() < 0.35 else n for n in shape)
        if dtype == "bool":
            mask = rng.random(shape) < 0.7
        else:
            mask = rng.standard_normal(shape) * 2
            mask[rng.random(shape) < 0.1] = -np.inf
        if shape[2] > 1:
            mask[..., rng.integers(shape[2]), :] = False if dtype == "bool" else -np.inf
        if dtype != "bfloat16":
            return mask.astype(dtype), None
        bits = bf16_bits(np, mask)
        return bf16_values(np, bits), bits

    def draw(self, side, nheads):
        return self.rng.standard_normal((self.batch, self.rows[side], nheads, self.head_dim))

    def ref(self, x):
        return x[0] if self.varlen else x

    def kernel_extras(self, spec, q, k, unused):
        from numba_flash.backends.numba.marshal import kernel_extras
        extras = self.extras
        if self.mask_bits is not None:
            extras = extras._replace(attn_mask=self.mask_bits)
        return kernel_extras(spec, extras, q, k, unused)

    def tiles(self, spec, q, k, unused):
        """The kernels' tile tables of a spec with a mask_mod (tile_classes.TileTables)."""
        from numba_flash.backends.numba.tile_classes import call_tiles
        return call_tiles(spec, self.extras, self.kernel_extras(spec, q, k, unused), q, k,
                          lambda shape, dtype: np.empty(shape, dtype), 0)


def run_forward(rng, shape, causal, dtype, config, kv_heads=None, lengths=None,
                launch=launch_mma_forward, **options):
    """`launch` (launch_mma_forward, or another family's launcher of the same arguments) on
    random 16-bit inputs into poisoned outputs; out checked by the rule against float64, lse
    against float64 (the same rows -inf, the others within 1e-4)."""
    nheads = shape[3]
    spec, kv_heads = make_case_spec(shape, causal, dtype, kv_heads, options, lengths)
    case = Layout(rng, spec, shape, lengths, options.get("mask_mod"))
    (qb, q), (kb, k), (vb, v) = (encode(case.draw(side, h), dtype) for side, h in
                                 ((0, nheads), (1, kv_heads), (1, kv_heads)))
    out = np.full(qb.shape, NAN16, np.uint16)  # poisoned
    lse = np.full(case.lse_shape, np.nan, np.float32)
    tiles = {"tiles": case.tiles(spec, qb, kb, lse)} if spec.mask_mod is not None else {}
    launch(spec, qb, kb, vb, out, lse, config=config,
           extras=case.kernel_extras(spec, qb, kb, lse), **tiles)
    q, k, v = (case.ref(x) for x in (q, k, v))
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64, case.extras)
    base_out, _ = plain16_forward(np, q, k, v, spec, dtype, case.extras)
    out, lse = case.ref(out), case.ref(lse)
    assert_within_rule("out", decode(out, dtype), base_out, ref_out, "float16")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.array_equal(lse[~finite], ref_lse[~finite])  # -inf where a row sees no key
    if finite.any():  # (a boolean mask may hide every key of every row: all -inf, checked)
        scale = max(1, np.abs(ref_lse[finite]).max())
        assert np.abs(lse[finite] - ref_lse[finite]).max() < 1e-4 * scale


def run_backward(rng, shape, causal, dtype, config, kv_heads=None, lengths=None,
                 launch=launch_mma_backward, **options):
    """`launch` (launch_mma_backward, or another family's launcher of the same arguments) on
    random 16-bit inputs (out, lse from float64 attention), each gradient checked by the rule
    against float64."""
    nheads = shape[3]
    spec, kv_heads = make_case_spec(shape, causal, dtype, kv_heads, options, lengths)
    case = Layout(rng, spec, shape, lengths, options.get("mask_mod"))
    sides = ((0, nheads), (1, kv_heads), (1, kv_heads), (0, nheads))
    (qb, q), (kb, k), (vb, v), (dob, do) = (encode(case.draw(side, h), dtype)
                                            for side, h in sides)
    q, k, v, do = (case.ref(x) for x in (q, k, v, do))
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64, case.extras)
    outb, out = encode(np.ascontiguousarray(ref_out), dtype)
    lse = np.ascontiguousarray(ref_lse, np.float32)
    grads = [np.full(x.shape, NAN16, np.uint16) for x in (qb, kb, vb)]  # poisoned
    delta = np.full(case.lse_shape, np.nan, np.float32)
    kernel_lse = lse.reshape(case.lse_shape)
    outb = outb.reshape(qb.shape)
    tiles = ({"tiles": case.tiles(spec, qb, kb, kernel_lse)} if spec.mask_mod is not None
             else {})
    launch(spec, dob, qb, kb, vb, outb, kernel_lse, delta, *grads, config=config,
           extras=case.kernel_extras(spec, qb, kb, kernel_lse), **tiles)
    refs = attention_backward(np, do, q, k, v, out, lse, spec, np.float64, case.extras)
    bases = plain16_backward(np, do, q, k, v, out, lse, spec, dtype, case.extras)
    for name, got, base, ref in zip(("dq", "dk", "dv"), grads, bases, refs):
        assert_within_rule(name, decode(case.ref(got), dtype), base, ref, "float16")


def sequence_map_rows(maps, count):
    """The rows of the Hopper kernels' tensor maps published to each varlen sequence's slots
    (hopper/tensor_maps.py; the simulator's map words: dims at 3-6, rows the third), as
    (sequences, count) for the first `count` maps of each."""
    words = maps.copy_to_host() if hasattr(maps, "copy_to_host") else np.asarray(maps)
    return words.view(np.uint64)[:, 5].reshape(-1, 4)[:, :count]
