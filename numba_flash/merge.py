"""merge(outs, lses): attention over the union of disjoint key sets from the attention over
each (split-KV decoding, ring attention, cascade inference with a shared-prefix cache).

Each part i is (out_i, lse_i) as numba_flash.forward returns them for the same queries and a
set of keys K_i: out_i = Σ_{j∈K_i} exp(s_j − lse_i) v_j and lse_i = log Σ_{j∈K_i} exp(s_j).
Over the union, lse = log Σ_i exp(lse_i) and out = Σ_i exp(lse_i − lse) out_i: exact, up to
rounding, computed from the largest lse of each row (so nothing overflows). A part whose
lse is −inf (it saw no key of that row) has weight 0 and its out is not read (0 · NaN would
poison the row); a row no part saw gets out 0 and lse −inf, as forward gives it.
"""
import numpy as np

from . import _arrays, _checks


def merge(outs, lses):
    """(out, lse) of the union of the parts' key sets.

    outs: (parts, batch, seqlen_q, nheads, headdim), or a list of (batch, seqlen_q, nheads,
    headdim) arrays; lses: (parts, batch, nheads, seqlen_q) float32 (or a list), the
    natural-log lse each part's forward returned. NumPy, CuPy or torch arrays (torch tensors
    are read through DLPack and get no gradient). Returns out like one part (its dtype,
    library and device) and lse float32 (batch, nheads, seqlen_q)."""
    parts_out, parts_lse = _parts("outs", outs, 4), _parts("lses", lses, 3)
    if len(parts_out) != len(parts_lse):
        raise ValueError(f"outs and lses must hold as many parts; got {len(parts_out)} and "
                         f"{len(parts_lse)}")
    batch, seqlen_q, nheads, _ = (int(n) for n in parts_out[0].shape)
    for i, (out, lse) in enumerate(zip(parts_out, parts_lse)):
        if tuple(out.shape) != tuple(parts_out[0].shape):
            raise ValueError(f"outs[{i}] has shape {tuple(out.shape)}; outs[0] "
                             f"{tuple(parts_out[0].shape)}")
        if tuple(lse.shape) != (batch, nheads, seqlen_q):
            raise ValueError(f"lses[{i}] must have shape (batch, nheads, seqlen_q) = "
                             f"{(batch, nheads, seqlen_q)}; got {tuple(lse.shape)}")
    named = {f"outs[{i}]": x for i, x in enumerate(parts_out)}
    named.update({f"lses[{i}]": x for i, x in enumerate(parts_lse)})
    _checks.check_same_place(named)
    ref = parts_out[0]
    xp, values = _module([*parts_out, *parts_lse])
    compute = np.float64 if _arrays.dtype_name(ref) == "float64" else np.float32
    out = xp.stack(values[:len(parts_out)]).astype(compute)
    lse = xp.stack(values[len(parts_out):]).astype(compute)
    top = lse.max(axis=0)
    top = xp.where(xp.isfinite(top), top, xp.zeros_like(top))
    weights = xp.exp(lse - top)  # (parts, batch, nheads, seqlen_q); 0 where lse is -inf
    total = weights.sum(axis=0)
    seen = total > 0
    weights = weights / xp.where(seen, total, xp.ones_like(total))
    per_row = weights.transpose(0, 1, 3, 2)[..., None]  # (parts, batch, seqlen_q, nheads, 1)
    merged = xp.where(per_row > 0, per_row * out, xp.zeros_like(out)).sum(axis=0)
    merged_lse = xp.where(seen, top + xp.log(xp.where(seen, total, xp.ones_like(total))),
                          xp.full_like(total, -np.inf))
    merged = _arrays.convert_like(merged, ref)
    torch_ref = _arrays.library(ref) == "torch"
    merged = merged.to(ref.dtype) if torch_ref else merged.astype(ref.dtype)
    return merged, _arrays.convert_like(merged_lse.astype(np.float32), ref)


def _parts(name, x, rank):
    """The parts of a stacked array (rank + 1 dimensions) or of a list of arrays."""
    if isinstance(x, (list, tuple)):
        parts = list(x)
    else:
        if _arrays.array_kind(x) is None or len(x.shape) != rank + 1:
            got = (type(x).__name__ if _arrays.array_kind(x) is None
                   else f"shape {tuple(x.shape)}")
            raise TypeError(f"{name} must be an array of {rank + 1} dimensions (parts first) or "
                            f"a list of {rank}-D arrays; got {got}")
        parts = [x[i] for i in range(int(x.shape[0]))]
    if not parts:
        raise ValueError(f"{name} must hold at least one part")
    for i, part in enumerate(parts):
        if _arrays.array_kind(part) is None or len(part.shape) != rank:
            raise TypeError(f"{name}[{i}] must be a {rank}-D array; got {type(part).__name__}")
    return parts


def _module(arrays):
    """(numpy or cupy, the arrays as that library's): torch tensors through DLPack
    (bfloat16 ones as float32, which NumPy and CuPy lack)."""
    arrays = [_arrays.detached(x) for x in arrays]
    arrays = [x.float() if _arrays.dtype_name(x) == "bfloat16" else x for x in arrays]
    if _arrays.array_kind(arrays[0]) == _arrays.HOST:
        return np, [np.asarray(_arrays.as_numpy(x)) for x in arrays]
    import cupy
    return cupy, [cupy.asarray(x) for x in arrays]
