"""The FlexAttention peer of scripts/bench_variants.py computes each row's attention: its
mask_mod and score_mod against numba_flash's float64 reference (eager FlexAttention on CPU
tensors), so that the bench compares like with like."""
import sys
from pathlib import Path

import numpy as np
import pytest

import numba_flash

torch = pytest.importorskip("torch")
pytest.importorskip("torch.nn.attention.flex_attention")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from flex_peer import flex_attention_call  # noqa: E402

N, H, H_KV, D = 160, 4, 2, 16
LENGTHS = [40, 75, 45]


@pytest.mark.parametrize("options, alibi, lengths", [
    (dict(causal=True), False, None), ({}, False, None),
    (dict(causal=True, window_size=(31, 0)), False, None),
    (dict(causal=True, softcap=5.0), False, None), (dict(causal=True), True, None),
    (dict(causal=True), False, LENGTHS)], ids=["causal", "full", "window", "softcap", "alibi",
                                               "varlen"])
def test_flex_peer_is_the_rows_attention(rng, options, alibi, lengths):
    q = rng.standard_normal((1, N, H, D))
    k, v = (rng.standard_normal((1, N, H_KV, D)) for _ in range(2))
    slopes = rng.uniform(0.05, 0.5, H).astype(np.float32) if alibi else None
    torch_slopes = None if slopes is None else torch.tensor(slopes, dtype=torch.float64)
    call = flex_attention_call(torch, options, N, "cpu", torch_slopes, lengths, compile=False)
    heads_first = [torch.from_numpy(x).transpose(1, 2) for x in (q, k, v)]
    got = call(*heads_first).transpose(1, 2).numpy()
    if lengths:
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        want = numba_flash.forward_varlen(q[0], k[0], v[0], cu, cu, max(lengths), max(lengths),
                                          backend="numpy", **options)[0][None]
    else:
        want = numba_flash.forward(q, k, v, alibi_slopes=slopes, backend="numpy", **options)[0]
    assert np.abs(got - want).max() < 1e-12
