"""Array checks for the public API (the options are numba_flash.spec's). Each raises one clear
error before any kernel launch."""
import numpy as np

from . import _arrays
from .extras import host_values
from .mask_mod import lower
from .spec import check_group, check_mask_mod

MAX_HEAD_DIM = 256
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _shape_str(x):
    return str(tuple(int(s) for s in x.shape))


def check_array(name, x):
    kind = _arrays.array_kind(x)
    if kind is None:
        raise TypeError(
            f"{name} must be an array (NumPy, CuPy, torch, or anything with "
            f"__cuda_array_interface__); got {type(x).__name__}")
    return kind


def check_qkv(q, k, v, varlen=False):
    """Check q, k, v shapes and dtypes (k and v may have fewer heads than q: GQA); return
    (batch, seqlen_q, seqlen_k, nheads, headdim), nheads q's. varlen: packed (total, nheads,
    headdim) arrays, whose batch (None here) and lengths the cu_seqlens say."""
    kinds = {name: check_array(name, x) for name, x in (("q", q), ("k", k), ("v", v))}
    layout = "3-D (total, nheads, headdim)" if varlen else "4-D (batch, seqlen, nheads, headdim)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != (3 if varlen else 4):
            raise ValueError(f"{name} must be {layout}; got shape {_shape_str(x)}")
    seqlen_q, nheads, headdim = (int(s) for s in q.shape[-3:])
    batch = None if varlen else int(q.shape[0])
    seqlen_k = int(k.shape[-3])
    for name, x in (("k", k), ("v", v)):
        if not varlen and int(x.shape[0]) != batch:
            raise ValueError(f"batch size mismatch: q has {batch}, {name} has {int(x.shape[0])}")
        if int(x.shape[-1]) != headdim:
            raise ValueError(f"headdim mismatch: q has {headdim}, {name} has {int(x.shape[-1])}")
    nheads_kv = int(k.shape[-2])
    if int(v.shape[-2]) != nheads_kv:
        raise ValueError(f"nheads mismatch: k has {nheads_kv}, v has {int(v.shape[-2])}")
    check_group(nheads, nheads_kv)
    if int(v.shape[-3]) != seqlen_k:
        raise ValueError(f"seqlen mismatch: k has {seqlen_k} keys, v has {int(v.shape[-3])}")
    if (not varlen and batch < 1) or nheads < 1:
        raise ValueError(f"batch and nheads must be >= 1; got q shape {_shape_str(q)}")
    if seqlen_q < 1 or seqlen_k < 1:
        what = "the total of tokens" if varlen else "seqlen"
        raise ValueError(f"{what} must be >= 1; got seqlen_q={seqlen_q} (q), "
                         f"seqlen_k={seqlen_k} (k, v)")
    if not 1 <= headdim <= MAX_HEAD_DIM:
        raise ValueError(f"headdim must be in 1..{MAX_HEAD_DIM}; got {headdim}")
    dtypes = {name: _arrays.dtype_name(x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(dtypes.values())) != 1:
        raise TypeError("q, k, v must have the same dtype; got " +
                        ", ".join(f"{n}={d}" for n, d in dtypes.items()))
    if dtypes["q"] not in FLOAT_DTYPES:
        raise TypeError(f"q, k, v must be floating point ({', '.join(FLOAT_DTYPES)}); "
                        f"got {dtypes['q']}")
    check_same_place({"q": q, "k": k, "v": v}, kinds)
    return batch, seqlen_q, seqlen_k, nheads, headdim


def check_same_place(arrays, kinds=None):
    """All arrays must live in one place: all on the host, or all on the same GPU."""
    kinds = kinds or {n: check_array(n, x) for n, x in arrays.items()}
    on_device = {n: _arrays.is_device_kind(k) for n, k in kinds.items()}
    if len(set(on_device.values())) != 1:
        where = ", ".join(f"{n} on {'GPU' if d else 'host'}" for n, d in on_device.items())
        raise ValueError(f"all arrays must be on the same device; got {where}")
    if all(on_device.values()):
        devices = {n: _arrays.device_id(x) for n, x in arrays.items()}
        if len(set(devices.values())) != 1:
            where = ", ".join(f"{n} on GPU {d}" for n, d in devices.items())
            raise ValueError(f"all arrays must be on the same GPU; got {where}")


def check_extras(spec, q, k, v, extras, known_offsets=(None, None)):
    """The call's arrays besides q, k, v (numba_flash.extras): ALiBi slopes of q's batch and
    heads; for varlen, cu_seqlens that agree with q, k and max_seqlen (their values are read:
    this check runs on every varlen call; known_offsets: cu_seqlens_q's and cu_seqlens_k's
    host values where the caller has them, offsets_to_device). Returns the batch size."""
    if spec.varlen:
        values_q, values_k = known_offsets  # (known: checked as arrays on the host)
        if values_q is None:
            check_offsets_array("cu_seqlens_q", extras.cu_seqlens_q)
            values_q = host_values(extras.cu_seqlens_q)
        if values_k is None:  # (self-attention passes one array twice: read once)
            same = extras.cu_seqlens_k is extras.cu_seqlens_q
            if not same:
                check_offsets_array("cu_seqlens_k", extras.cu_seqlens_k)
            values_k = values_q if same else host_values(extras.cu_seqlens_k)
        batch = check_cu_seqlens("cu_seqlens_q", values_q, int(q.shape[0]),
                                 spec.max_seqlen_q, "max_seqlen_q")
        batch_k = check_cu_seqlens("cu_seqlens_k", values_k, int(k.shape[0]),
                                   spec.max_seqlen_k, "max_seqlen_k")
        if batch_k != batch:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch "
                             f"+ 1); got {batch + 1} and {batch_k + 1}")
    else:
        batch = int(q.shape[0])
    if spec.alibi:
        check_alibi_slopes(extras.alibi_slopes, batch, int(q.shape[-2]))
    if spec.attn_mask is not None:
        check_attn_mask(extras.attn_mask, spec, (batch, int(q.shape[-2]), int(q.shape[-3]),
                                                 int(k.shape[-3])))
    if extras.block_mask is not None:
        extras.block_mask.check_call(batch, int(q.shape[-2]), int(q.shape[-3]),
                                     int(k.shape[-3]))
    named = {"q": q, **{name: x for name, x in zip(extras._fields[:4], extras) if x is not None}}
    if extras.mask_mod_arrays:
        named.update((f"mask_mod's captured {name!r}", x)
                     for name, x in zip(spec.mask_mod.captured, extras.mask_mod_arrays))
    if len(named) > 1:
        check_same_place(named)
    return batch


def check_backward_args(dout, q, k, v, out, lse, varlen=False):
    batch, seqlen_q, seqlen_k, nheads, headdim = check_qkv(q, k, v, varlen)
    for name, x in (("dout", dout), ("out", out)):
        check_array(name, x)
        if tuple(int(s) for s in x.shape) != tuple(int(s) for s in q.shape):
            raise ValueError(f"{name} must have q's shape {_shape_str(q)}; got {_shape_str(x)}")
        if _arrays.dtype_name(x) != _arrays.dtype_name(q):
            raise TypeError(f"{name} must have q's dtype {_arrays.dtype_name(q)}; "
                            f"got {_arrays.dtype_name(x)}")
    check_array("lse", lse)
    want, names = ((nheads, seqlen_q), "(nheads, total_q)") if varlen else (
        (batch, nheads, seqlen_q), "(batch, nheads, seqlen_q)")
    if tuple(int(s) for s in lse.shape) != want:
        raise ValueError(f"lse must have shape {names} = {want}; got {_shape_str(lse)}")
    if _arrays.dtype_name(lse) != "float32":
        raise TypeError(f"lse must be float32 (as returned by forward); "
                        f"got {_arrays.dtype_name(lse)}")
    check_same_place({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse})
    return batch, seqlen_q, seqlen_k, nheads, headdim


def check_alibi_slopes(alibi_slopes, batch, nheads):
    """float32, of shape (nheads,) or (batch, nheads)."""
    if _arrays.array_kind(alibi_slopes) is None:
        raise TypeError(f"alibi_slopes must be an array (float32, (nheads,) or (batch, nheads)); "
                        f"got {type(alibi_slopes).__name__}")
    shape = tuple(int(s) for s in alibi_slopes.shape)
    if shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, "
                         f"nheads) = ({batch}, {nheads}); got {_shape_str(alibi_slopes)}")
    if _arrays.dtype_name(alibi_slopes) != "float32":
        raise TypeError(f"alibi_slopes must be float32; got {_arrays.dtype_name(alibi_slopes)}")


def mask_dtype(attn_mask):
    """The dtype name of an attention mask ("bool" or a float dtype's), None for None: what
    the call's spec holds (its shape is check_attn_mask's)."""
    if attn_mask is None:
        return None
    if _arrays.array_kind(attn_mask) is None:
        raise TypeError(f"attn_mask must be an array (boolean or floating, broadcastable to "
                        f"(batch, nheads, seqlen_q, seqlen_k)) or None; got "
                        f"{type(attn_mask).__name__}")
    dtype = _arrays.dtype_name(attn_mask)
    if dtype != "bool" and dtype not in FLOAT_DTYPES:
        raise TypeError(f"attn_mask must be boolean (True: the query sees the key) or floating "
                        f"(added to the scores); got {dtype}")
    return dtype


def lowered_mask_mod(mask_mod, block_mask=None, varlen=False):
    """(MaskModProgram, its captured arrays) of the call's mask_mod (mask_mod_of's), checked;
    (None, ()) without one (at once: the usual call's path)."""
    if mask_mod is None and block_mask is None:
        return None, ()
    program, captured = lower(check_mask_mod(mask_mod_of(mask_mod, block_mask, varlen)))
    for name, x in zip(program.captured if program else (), captured):
        if _arrays.dtype_name(x) == "bfloat16":
            raise TypeError(f"mask_mod {program.name!r} captures {name!r}, a bfloat16 array, "
                            f"which the kernels cannot index: capture it as float32")
    return program, captured


def mask_mod_of(mask_mod, block_mask, varlen=False):
    """The call's mask_mod: the one given, or block_mask's (they must be the same function).
    varlen calls take no block mask (their tiles depend on cu_seqlens: classified per call)."""
    if block_mask is None:
        return mask_mod
    from .block_mask import BlockMask
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask from numba_flash.block_mask(...) or "
                        f"None; got {type(block_mask).__name__}")
    if varlen:
        raise ValueError("block_mask is for calls on (batch, seqlen, ...) arrays; a varlen call "
                         "with mask_mod classifies its tiles itself (they depend on cu_seqlens)")
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError(f"mask_mod and block_mask disagree: block_mask was built for "
                         f"{block_mask.mask_mod.__name__!r}, mask_mod is "
                         f"{getattr(mask_mod, '__name__', type(mask_mod).__name__)!r}")
    return block_mask.mask_mod


def check_attn_mask(attn_mask, spec, shape):
    """Broadcastable to shape = (batch, nheads, seqlen_q, seqlen_k) (each of its last four
    dimensions 1 or shape's); a floating mask of q's dtype or float32."""
    if spec.float_mask and spec.attn_mask not in (spec.dtype, "float32"):
        raise TypeError(f"a floating attn_mask must have q's dtype {spec.dtype} or float32; "
                        f"got {spec.attn_mask}")
    mask_shape = tuple(int(s) for s in attn_mask.shape)
    padded = (1,) * (4 - len(mask_shape)) + mask_shape
    if len(mask_shape) > 4 or any(m not in (1, n) for m, n in zip(padded, shape)):
        raise ValueError(f"attn_mask must broadcast to (batch, nheads, seqlen_q, seqlen_k) = "
                         f"{shape} (each dimension 1 or that size); got {mask_shape}")


def check_offsets_array(name, cu_seqlens):
    """An int32 (batch + 1,) array, batch >= 1 (its values are check_cu_seqlens')."""
    if _arrays.array_kind(cu_seqlens) is None:
        raise TypeError(f"{name} must be an int32 array of shape (batch + 1,); got "
                        f"{type(cu_seqlens).__name__}")
    if _arrays.dtype_name(cu_seqlens) != "int32":
        raise TypeError(f"{name} must be int32; got {_arrays.dtype_name(cu_seqlens)}")
    if len(cu_seqlens.shape) != 1 or int(cu_seqlens.shape[0]) < 2:
        raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1; got "
                         f"{_shape_str(cu_seqlens)}")


def host_arrays_to_device(q, named, check):
    """(arrays, known) for `named`, (name, array) pairs: with q on a GPU, the arrays given on
    the host (NumPy, a CPU torch tensor; not None or a plain int) checked by check(name, x),
    all before anything is copied, then copied to q's device without waiting (an array named
    twice, once), their host values in known (a copy: the caller may change its array); None
    in known for the others, whose checks must read them back from the GPU."""
    arrays, known = [x for _, x in named], [None] * len(named)
    if not _arrays.is_device_kind(_arrays.array_kind(q)):
        return arrays, tuple(known)
    on_host = [x is not None and not isinstance(x, (int, np.integer))
               and _arrays.array_kind(x) == _arrays.HOST for x in arrays]
    for (name, x), host in zip(named, on_host):
        if host:
            check(name, x)
    copies = {}
    for i, x in enumerate(arrays):
        if on_host[i]:
            if id(x) not in copies:
                values = np.array(_arrays.as_numpy(x))
                copies[id(x)] = (values, _arrays.device_copy_like(values, q))
            known[i], arrays[i] = copies[id(x)]
    return arrays, tuple(known)


def offsets_to_device(q, cu_seqlens_q, cu_seqlens_k):
    """(cu_seqlens_q, cu_seqlens_k, known): host_arrays_to_device's for varlen's offsets."""
    (cu_q, cu_k), known = host_arrays_to_device(
        q, (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)), check_offsets_array)
    return cu_q, cu_k, known


def check_cu_seqlens(name, values, total, max_seqlen, max_name):
    """The host values of int32 (batch + 1,) offsets (check_offsets_array's): 0 first,
    non-decreasing, `total` last, no sequence longer than max_seqlen. Returns the batch size."""
    values = np.asarray(values).astype(np.int64)
    lengths = np.diff(values)
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0; got {int(values[0])}")
    if (lengths < 0).any():
        at = int(np.argmax(lengths < 0))
        raise ValueError(f"{name} must be non-decreasing; got {int(values[at])} then "
                         f"{int(values[at + 1])} at positions {at}, {at + 1}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the total number of tokens, {total}; got "
                         f"{int(values[-1])}")
    longest = int(lengths.max())
    if longest > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} is less than the longest sequence in "
                         f"{name}, {longest}")
    return len(values) - 1
