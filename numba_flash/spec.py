"""The one description of an attention call: AttentionSpec, and its validation.

The public API builds a spec from its options and q (one clear error per bad option), and
everything below takes the spec: the registry and the backends (`supports(spec, ...)`,
`forward(spec, ...)`), the Numba engines, the float64 reference, the call cache (the spec is
part of a call's signature) and the kernel factories, whose `functools.lru_cache` key it is.
Kernels see `spec.for_kernels()`, the spec without its run-time values (softmax_scale is a
kernel argument), so that a new scale compiles nothing.

A variant is added here first: a field (with its default: the plain attention), its check in
`make_spec`, and its meaning in numba_flash/reference.py.
"""
import dataclasses
import functools
import math

from numba_flash import _arrays

# The kernels scale in float32 with log2(e) folded in: a scale that rounds to 0 or to inf there
# would turn masked scores (-inf) into NaN.
_FLOAT32_SCALE_MIN = 1e-38  # scale · log2(e) stays a normal float32
_FLOAT32_SCALE_MAX = 1e38  # and finite


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Every option of one call, with the facts of q the kernels are built for.

    causal: query i sees key j iff j <= i + seqlen_k - seqlen_q (bottom-right aligned).
    softmax_scale: the resolved scale (headdim ** -0.5 by default); None in for_kernels().
    head_dim, dtype: q's head dim and dtype name ('float16', 'bfloat16', ...).
    """

    head_dim: int
    dtype: str
    causal: bool = False
    softmax_scale: float | None = None

    def __post_init__(self):
        # the spec is hashed on every call (the call cache's signature): once is enough
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self):
        return self._hash

    def for_kernels(self, **changes):
        """The spec a kernel factory is keyed on: run-time values cleared, with `changes`
        (e.g. the padded head dim a kernel family runs at)."""
        return dataclasses.replace(self, softmax_scale=None, **changes)

    @property
    def bf16(self):
        """Whether the kernels see bfloat16 bit patterns."""
        return self.dtype == "bfloat16"


def check_causal(causal):
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    return causal


def resolve_softmax_scale(softmax_scale, head_dim):
    """None -> head_dim ** -0.5; otherwise a finite positive float within float32's range."""
    if softmax_scale is None:
        return float(head_dim) ** -0.5
    try:
        if isinstance(softmax_scale, (bool, str, bytes)):  # float() would take these
            raise TypeError
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise TypeError(f"softmax_scale must be a finite positive number or None; "
                        f"got {softmax_scale!r}") from None
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale must be a finite positive number or None; "
                         f"got {softmax_scale!r}")
    if not _FLOAT32_SCALE_MIN <= scale <= _FLOAT32_SCALE_MAX:
        raise ValueError(f"softmax_scale must be a finite positive number within float32 range "
                         f"({_FLOAT32_SCALE_MIN:.0e} to {_FLOAT32_SCALE_MAX:.0e}) or None; "
                         f"got {softmax_scale!r}")
    return scale


def _build(head_dim, dtype, causal, softmax_scale):
    """dtype: a name, or an array's dtype object (numpy or torch)."""
    dtype = dtype if isinstance(dtype, str) else _arrays._dtype_name(dtype)
    check_causal(causal)
    # (a q without a valid head dim meets its error in the array checks, before any use)
    scale = resolve_softmax_scale(softmax_scale, max(head_dim, 1))
    return AttentionSpec(head_dim=head_dim, dtype=dtype, causal=causal, softmax_scale=scale)


# Repeated calls make the same spec: built once per options (errors are raised, not cached).
_cached_build = functools.lru_cache(maxsize=256)(_build)


def make_spec(q, *, causal=False, softmax_scale=None):
    """The spec of a call on q (any array the API takes) with these options; TypeError or
    ValueError naming the option that is wrong. q's own checks (rank, dtype, shapes) are
    numba_flash._checks'; a q without a head dim gets its error there."""
    shape = getattr(q, "shape", None)
    head_dim = int(shape[-1]) if shape is not None and len(shape) else 0
    dtype = getattr(q, "dtype", "")
    if type(causal) is bool and type(softmax_scale) in (float, int, type(None)):
        return _cached_build(head_dim, dtype, causal, softmax_scale)
    return _build(head_dim, dtype, causal, softmax_scale)
