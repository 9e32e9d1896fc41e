"""The accuracy rule of DESIGN.md, for the tests and scripts/verify.py.

A backend's max error against a float64 reference must be at most twice the error of a plain
implementation in the input precision (standard attention computed in that dtype), plus a small
floor relative to the magnitude of the values.
"""
import numpy as np

FLOOR = {"float16": 1e-4, "bfloat16": 1e-3, "float32": 1e-5, "float64": 1e-12}


def max_error(got, ref):
    """Max |got - ref| over the entries where ref is finite. Non-finite entries must match the
    reference's exactly (NaN where it has NaN, -inf lse of a row with no key, ...); any other
    mismatch returns inf."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"shape {got.shape} differs from the reference's {ref.shape}")
    finite = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got), finite) or \
            not np.array_equal(got[~finite], ref[~finite], equal_nan=True):
        return float("inf")
    return float(np.abs(got[finite] - ref[finite]).max()) if finite.any() else 0.0


def error_bound(baseline_error, ref, dtype):
    """2 x the plain implementation's error + FLOOR[dtype] x max(1, max |ref|)."""
    if not np.isfinite(baseline_error):  # an infinite bound would let anything pass
        raise ValueError("the baseline's non-finite entries differ from the reference's")
    ref = np.asarray(ref, np.float64)
    finite = ref[np.isfinite(ref)]
    scale = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0
    return 2.0 * baseline_error + FLOOR[str(dtype)] * scale
