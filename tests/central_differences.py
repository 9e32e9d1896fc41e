"""The backward's check against the derivative, shared by the float64 tests of the variants."""


def assert_is_the_derivative(rng, grads, loss, arrays, samples=5, eps=1e-6):
    """Each of grads (of q, k, v) against central differences of loss(q, k, v) at `samples`
    random entries of each array (arrays: the float64 q, k, v the grads are of)."""
    for which, grad in enumerate(grads):
        for _ in range(samples):
            moved = [x.copy() for x in arrays]
            index = tuple(int(rng.integers(0, n)) for n in moved[which].shape)
            moved[which][index] += eps
            up = loss(*moved)
            moved[which][index] -= 2 * eps
            numeric = (up - loss(*moved)) / (2 * eps)
            # (a backward that recomputes P from the float32 lse: a few 1e-7 relative)
            assert abs(grad[index] - numeric) < 1e-6 * max(1.0, abs(numeric)), (which, index)
