"""Random attention inputs for the tests (never zeros, fresh per test)."""
import numpy as np


def random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, headdim, dtype):
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, nheads, headdim)).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, nheads, headdim)).astype(dtype)
    return q, k, v
