"""Array checks for the public API (the options are numba_flash.spec's). Each raises one clear
error before any kernel launch."""
from . import _arrays
from .spec import check_group

MAX_HEAD_DIM = 256
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _shape_str(x):
    return "(" + ", ".join(str(int(s)) for s in x.shape) + ")"


def check_array(name, x):
    kind = _arrays.array_kind(x)
    if kind is None:
        raise TypeError(
            f"{name} must be an array (NumPy, CuPy, torch, or anything with "
            f"__cuda_array_interface__); got {type(x).__name__}")
    return kind


def check_qkv(q, k, v):
    """Check q, k, v shapes and dtypes (k and v may have fewer heads than q: GQA); return
    (batch, seqlen_q, seqlen_k, nheads, headdim), nheads q's."""
    kinds = {name: check_array(name, x) for name, x in (("q", q), ("k", k), ("v", v))}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, nheads, headdim); got shape {_shape_str(x)}")
    batch, seqlen_q, nheads, headdim = (int(s) for s in q.shape)
    seqlen_k = int(k.shape[1])
    for name, x in (("k", k), ("v", v)):
        if int(x.shape[0]) != batch:
            raise ValueError(f"batch size mismatch: q has {batch}, {name} has {int(x.shape[0])}")
        if int(x.shape[3]) != headdim:
            raise ValueError(f"headdim mismatch: q has {headdim}, {name} has {int(x.shape[3])}")
    nheads_kv = int(k.shape[2])
    if int(v.shape[2]) != nheads_kv:
        raise ValueError(f"nheads mismatch: k has {nheads_kv}, v has {int(v.shape[2])}")
    check_group(nheads, nheads_kv)
    if int(v.shape[1]) != seqlen_k:
        raise ValueError(f"seqlen mismatch: k has {seqlen_k} keys, v has {int(v.shape[1])}")
    if batch < 1 or nheads < 1:
        raise ValueError(f"batch and nheads must be >= 1; got q shape {_shape_str(q)}")
    if seqlen_q < 1 or seqlen_k < 1:
        raise ValueError(
            f"seqlen must be >= 1; got seqlen_q={seqlen_q} (q), seqlen_k={seqlen_k} (k, v)")
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


def check_backward_args(dout, q, k, v, out, lse):
    batch, seqlen_q, seqlen_k, nheads, headdim = check_qkv(q, k, v)
    for name, x in (("dout", dout), ("out", out)):
        check_array(name, x)
        if tuple(int(s) for s in x.shape) != tuple(int(s) for s in q.shape):
            raise ValueError(f"{name} must have q's shape {_shape_str(q)}; got {_shape_str(x)}")
        if _arrays.dtype_name(x) != _arrays.dtype_name(q):
            raise TypeError(f"{name} must have q's dtype {_arrays.dtype_name(q)}; "
                            f"got {_arrays.dtype_name(x)}")
    check_array("lse", lse)
    want = (batch, nheads, seqlen_q)
    if tuple(int(s) for s in lse.shape) != want:
        raise ValueError(f"lse must have shape (batch, nheads, seqlen_q) = {want}; "
                         f"got {_shape_str(lse)}")
    if _arrays.dtype_name(lse) != "float32":
        raise TypeError(f"lse must be float32 (as returned by forward); "
                        f"got {_arrays.dtype_name(lse)}")
    check_same_place({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse})
    return batch, seqlen_q, seqlen_k, nheads, headdim
