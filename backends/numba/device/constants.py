"""float32 constants of the Numba kernels."""
import math

import numpy as np

LOG2E = np.float32(1.4426950408889634)  # scores are kept in log2 units: exp(x) = exp2(x·log2 e)
LN2 = np.float32(math.log(2.0))
NEG_INF = np.float32(-np.inf)
POS_INF = np.float32(np.inf)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
