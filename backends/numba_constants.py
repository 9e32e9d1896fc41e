"""float32 constants and tiny helpers shared by the Numba kernels (closure constants there)."""
import math

import numpy as np

LOG2E = np.float32(1.4426950408889634)  # scores are kept in log2 units: exp(x) = exp2(x·log2 e)
LN2 = np.float32(math.log(2.0))
NEG_INF = np.float32(-np.inf)
POS_INF = np.float32(np.inf)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)


def lse_log2(value):
    """lse in log2 units; a row that saw no key (lse = -inf) gets +inf so that
    P = exp2(S - lse) = 0 there instead of NaN. Compiled inline as a device function."""
    return value * LOG2E if value != NEG_INF else POS_INF
