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
import inspect
import math
import numbers

from numba_flash import _arrays
from numba_flash.mask_mod import MaskModProgram, lower

# The kernels scale in float32 with log2(e) folded in: a scale that rounds to 0 or to inf there
# would turn masked scores (-inf) into NaN.
_FLOAT32_SCALE_MIN = 1e-38  # scale · log2(e) stays a normal float32
_FLOAT32_SCALE_MAX = 1e38  # and finite


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Every option of one call, with the facts of q the kernels are built for.

    head_dim, dtype: q's head dim and dtype name ('float16', 'bfloat16', ...).
    causal: query i sees key j iff j <= i + seqlen_k - seqlen_q (bottom-right aligned); the
        same as window_right = 0, and either sets the other.
    softmax_scale: the resolved scale (headdim ** -0.5 by default); None in for_kernels().
    window_left, window_right: query i sees key j iff i + seqlen_k - seqlen_q - window_left
        <= j <= i + seqlen_k - seqlen_q + window_right; -1 leaves that side unbounded.
    softcap: > 0 replaces the scaled score s by softcap · tanh(s / softcap); 0 leaves it.
    group: query heads per key/value head (GQA; 1 for multi-head attention): query head h
        reads key/value head h // group.
    alibi: whether the call has ALiBi slopes (numba_flash.extras): -slope · |i + seqlen_k -
        seqlen_q - j| is added to the (softcapped) scaled score.
    varlen: packed sequences (forward_varlen): q, k, v are (total, nheads, headdim) and
        cu_seqlens (numba_flash.extras) say where each sequence starts; every sequence attends
        within itself, with its own seqlen_q and seqlen_k.
    max_seqlen_q, max_seqlen_k: varlen's longest sequences (upper bounds; they size the
        grid); None otherwise and in for_kernels().
    attn_mask: the dtype name of the call's attention mask (numba_flash.extras), None
        without one: "bool" (True: the query sees the key) or a float dtype (added to the
        softcapped scaled score, after ALiBi), SDPA's meaning; read tile by tile.
    mask_mod: None, or a Python function mask_mod(b, h, q_idx, kv_idx) -> bool
        (FlexAttention's signature): query q_idx of batch entry b (varlen: sequence b, indices
        within it) and query head h sees key kv_idx only where it returns True. It is
        compiled into the kernels, so the spec holds it as numba_flash.mask_mod's
        MaskModProgram (a function given is lowered to one): its code with the arrays it
        captures as parameters, whose values travel in the call's Extras.
    """

    head_dim: int
    dtype: str
    causal: bool = False
    softmax_scale: float | None = None
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    group: int = 1
    alibi: bool = False
    varlen: bool = False
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    attn_mask: str | None = None
    mask_mod: object = None

    def __post_init__(self):
        if self.mask_mod is not None and not isinstance(self.mask_mod, MaskModProgram):
            object.__setattr__(self, "mask_mod", lower(check_mask_mod(self.mask_mod))[0])
        if self.causal or self.window_right == 0:  # one spec for one meaning
            object.__setattr__(self, "causal", True)
            object.__setattr__(self, "window_right", 0)
        # the spec is hashed on every call (the call cache's signature): once is enough
        object.__setattr__(self, "_hash", hash(tuple(
            getattr(self, field.name) for field in dataclasses.fields(self))))

    def __hash__(self):
        return self._hash

    def for_kernels(self, **changes):
        """The spec a kernel factory is keyed on: run-time values cleared, with `changes`
        (e.g. the padded head dim a kernel family runs at)."""
        return dataclasses.replace(self, softmax_scale=None, max_seqlen_q=None,
                                   max_seqlen_k=None, **changes)

    @property
    def bf16(self):
        """Whether the kernels see bfloat16 bit patterns."""
        return self.dtype == "bfloat16"

    @property
    def windowed(self):
        """Whether some keys are out of some query's sight (causal or a window)."""
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def score_modded(self):
        """Whether scores are changed before the softmax (softcap, ALiBi, a float mask)."""
        return bool(self.softcap) or self.alibi or self.float_mask

    @property
    def bool_mask(self):
        """Whether a boolean attention mask says which keys each query sees."""
        return self.attn_mask == "bool"

    @property
    def float_mask(self):
        """Whether a floating attention mask is added to the scores."""
        return self.attn_mask is not None and self.attn_mask != "bool"


def check_causal(causal):
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    return causal


def check_window_size(window_size):
    """(left, right): two ints, each -1 (unbounded) or >= 0."""
    message = ("window_size must be a pair of ints (left, right), each -1 (unbounded) or >= 0; "
               f"got {window_size!r}")
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(message) from None
    for side in (left, right):
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(message)
        if side < -1:
            raise ValueError(message)
    return int(left), int(right)


def check_softcap(softcap):
    """A finite float >= 0 (0: no softcapping)."""
    message = f"softcap must be a finite number >= 0 (0 turns it off); got {softcap!r}"
    if isinstance(softcap, (bool, str, bytes)) or not isinstance(softcap, numbers.Real):
        raise TypeError(message)
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0.0:
        raise ValueError(message)
    return softcap


def check_group(nheads_q, nheads_kv):
    """Query heads per key/value head: nheads_q a multiple of nheads_kv."""
    if nheads_kv < 1 or nheads_q % nheads_kv:
        raise ValueError(f"nheads of q must be a multiple of nheads of k and v (grouped-query "
                         f"attention); got q with {nheads_q} heads, k with {nheads_kv}")
    return nheads_q // nheads_kv


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


def check_mask_mod(mask_mod):
    """None, or a function that takes (b, h, q_idx, kv_idx) (or its MaskModProgram)."""
    if mask_mod is None or isinstance(mask_mod, MaskModProgram):
        return mask_mod
    message = ("mask_mod must be a Python function mask_mod(b, h, q_idx, kv_idx) -> bool (or "
               "None)")
    if not inspect.isfunction(mask_mod):  # (what Numba compiles: no partials, no methods)
        raise TypeError(f"{message}; got {type(mask_mod).__name__}")
    if not _binds_four_indices(mask_mod):
        raise TypeError(f"{message}; got {getattr(mask_mod, '__name__', mask_mod)!r}, which "
                        f"does not take four positional arguments")
    return mask_mod


_FOUR_INDICES = {}  # {(code, defaults count, keyword defaults' names): _binds_four_indices}


def _binds_four_indices(function):
    """Whether function binds four positional arguments. Every call with a mask_mod asks (inspect
    took a tenth of such a call's host time): the answers are kept by what binding depends on,
    not by function (which would keep the arrays it captures alive); a wrapper, whose signature
    is its __wrapped__'s or __signature__, is asked each time."""
    wrapper = "__wrapped__" in vars(function) or "__signature__" in vars(function)
    key = (function.__code__, len(function.__defaults__ or ()),
           tuple(sorted(function.__kwdefaults__ or ())))
    known = None if wrapper else _FOUR_INDICES.get(key)
    if known is None:
        try:
            inspect.signature(function).bind(0, 0, 0, 0)
            known = True
        except TypeError:
            known = False
        if not wrapper:
            if len(_FOUR_INDICES) >= 256:
                _FOUR_INDICES.clear()
            _FOUR_INDICES[key] = known
    return known


def check_max_seqlen(name, value):
    """varlen's max_seqlen_q / max_seqlen_k: an int >= 1."""
    message = f"{name} must be an int >= 1 (the longest sequence's length, or more); got {value!r}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(message)
    if value < 1:
        raise ValueError(message)
    return int(value)


def _build(head_dim, dtype, nheads, nheads_kv, causal, softmax_scale, window_size, softcap,
           alibi, max_seqlens, attn_mask, mask_mod):
    """dtype: a name, or an array's dtype object (numpy or torch); nheads, nheads_kv: of q
    and k, None where unknown (then no GQA: the array checks will say what is wrong);
    max_seqlens: varlen's (max_seqlen_q, max_seqlen_k), or None; attn_mask: the mask's dtype
    name, or None; mask_mod: a function or None."""
    dtype = dtype if isinstance(dtype, str) else _arrays._dtype_name(dtype)
    group = 1 if nheads is None or nheads_kv is None else check_group(nheads, nheads_kv)
    check_causal(causal)
    # (a q without a valid head dim meets its error in the array checks, before any use)
    scale = resolve_softmax_scale(softmax_scale, max(head_dim, 1))
    left, right = check_window_size(window_size)
    varlen = max_seqlens is not None
    if varlen:
        max_seqlens = (check_max_seqlen("max_seqlen_q", max_seqlens[0]),
                       check_max_seqlen("max_seqlen_k", max_seqlens[1]))
    return AttentionSpec(head_dim=head_dim, dtype=dtype, causal=causal, softmax_scale=scale,
                         window_left=left, window_right=right, softcap=check_softcap(softcap),
                         group=group, alibi=bool(alibi), varlen=varlen,
                         max_seqlen_q=max_seqlens[0] if varlen else None,
                         max_seqlen_k=max_seqlens[1] if varlen else None, attn_mask=attn_mask,
                         mask_mod=mask_mod)


_SCALAR_TYPES = (float, int, type(None))
#: window_size's default: no window (the API's functions share this object, so that the
#: usual call skips the check of a pair)
NO_WINDOW = (-1, -1)

# Repeated calls make the same spec: built once per options (errors are raised, not cached).
_cached_build = functools.lru_cache(maxsize=256)(_build)


def _plain_pair(window_size):
    return (type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int)


def make_spec(q, k=None, *, causal=False, softmax_scale=None, window_size=NO_WINDOW,
              softcap=0.0, alibi=False, max_seqlens=None, attn_mask=None, mask_mod=None):
    """The spec of a call on q and k (any arrays the API takes; k for its number of heads,
    GQA) with these options (alibi: whether ALiBi slopes come with the call; max_seqlens:
    varlen's (max_seqlen_q, max_seqlen_k), q and k then (total, nheads, headdim); attn_mask:
    the dtype name of the call's mask, _checks.mask_dtype's; mask_mod: the function or its
    MaskModProgram); TypeError or ValueError naming the option that is wrong. The arrays' own
    checks (rank, dtype, shapes) are numba_flash._checks'; a q without a head dim gets its
    error there."""
    rank = 3 if max_seqlens is not None else 4  # (the API's arrays: head dim and heads)
    shape = getattr(q, "shape", None)
    if shape is not None and len(shape) == rank:
        head_dim, nheads = int(shape[-1]), shape[-2]
    else:
        head_dim, nheads = (int(shape[-1]) if shape is not None and len(shape) else 0), None
    k_shape = None if k is None else getattr(k, "shape", None)
    nheads_kv = k_shape[-2] if k_shape is not None and len(k_shape) == rank else None
    dtype = getattr(q, "dtype", "")
    mask_mod = check_mask_mod(mask_mod)  # (before the cache, which hashes it)
    if (type(causal) is bool and type(softmax_scale) in _SCALAR_TYPES
            and type(softcap) in _SCALAR_TYPES
            and (window_size is NO_WINDOW or _plain_pair(window_size))
            and (max_seqlens is None or _plain_pair(max_seqlens))):
        return _cached_build(head_dim, dtype, nheads, nheads_kv, causal, softmax_scale,
                             window_size, softcap, alibi, max_seqlens, attn_mask, mask_mod)
    return _build(head_dim, dtype, nheads, nheads_kv, causal, softmax_scale, window_size,
                  softcap, alibi, max_seqlens, attn_mask, mask_mod)
