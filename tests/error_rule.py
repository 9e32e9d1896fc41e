"""Assertion form of the accuracy rule in numba_flash.testing."""
from numba_flash.testing import error_bound, max_error


def assert_within_rule(name, got, baseline, ref, dtype):
    err, limit = max_error(got, ref), error_bound(max_error(baseline, ref), ref, dtype)
    assert err <= limit, f"{name}: max error {err:.3g} > bound {limit:.3g} ({dtype})"
    return err, limit
