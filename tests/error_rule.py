"""The accuracy rule of DESIGN.md, shared by the test files.

A backend's max error against the float64 reference must be at most twice the error of a plain
implementation in the input precision (the same standard algorithm, computed in that dtype),
plus a small floor relative to the size of the values.
"""
import numpy as np

FLOOR = {"float32": 1e-5, "float16": 1e-4, "float64": 1e-12}


def max_error(got, ref):
    """Max |got - ref| over entries where ref is finite; non-finite entries must match exactly."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), finite), "non-finite entries differ from reference"
    assert np.array_equal(got[~finite], ref[~finite]), "inf entries differ from reference"
    return float(np.abs(got[finite] - ref[finite]).max()) if finite.any() else 0.0


def bound(baseline, ref, dtype):
    """2 x the baseline's error + a floor scaled by the magnitude of the reference values."""
    ref = np.asarray(ref, np.float64)
    finite = ref[np.isfinite(ref)]
    scale = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0
    return 2.0 * max_error(baseline, ref) + FLOOR[dtype] * scale


def assert_within_rule(name, got, baseline, ref, dtype):
    err, limit = max_error(got, ref), bound(baseline, ref, dtype)
    assert err <= limit, f"{name}: max error {err:.3g} > bound {limit:.3g} ({dtype})"
    return err, limit
