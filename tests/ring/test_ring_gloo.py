"""ring_attention over torch.distributed + gloo, 2 and 4 processes on this machine, the kernels
in the CUDA simulator: the gathered output and gradients against float64 attention over the
whole sequence, by the accuracy rule; the bad calls refused on every rank, without a hang."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from error_rule import assert_within_rule
from inputs import random_qkv

from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import make_spec

torch = pytest.importorskip("torch")

WORKER = os.path.join(os.path.dirname(__file__), "ring_worker.py")


def case(name, layout="zigzag", causal=True, window=(-1, -1), softcap=0.0, nheads=2,
         nheads_kv=2, dtype="float32", backend="numba", seqlen=16):
    return dict(name=name, layout=layout, causal=causal, window=list(window), softcap=softcap,
                nheads=nheads, nheads_kv=nheads_kv, dtype=dtype, backend=backend,
                seqlen=seqlen, scale=None)


# The numba kernels (simulated: ~5 s a forward call at these sizes) for one ring; the numpy
# backend for the sample of layouts, windows and variants (the ring's plan, its messages and
# merges are the same whichever backend computes the blocks).
CASES = {
    2: [case("zigzag_causal", backend="numpy"), case("zigzag_causal_numba"),
        case("contiguous_causal", layout="contiguous", backend="numpy"),
        case("zigzag_full", causal=False, backend="numpy"),
        case("contiguous_full", layout="contiguous", causal=False, backend="numpy"),
        case("zigzag_gqa", nheads=4, nheads_kv=1, backend="numpy"),
        case("zigzag_window_softcap", window=(5, 0), causal=False, softcap=2.0,
             backend="numpy"),
        case("contiguous_window", layout="contiguous", causal=False, window=(3, 2),
             backend="numpy"),
        case("zigzag_window_wide", causal=False, window=(6, 9), backend="numpy", seqlen=24)],
    4: [case("zigzag_causal", backend="numpy"),
        case("contiguous_causal", layout="contiguous", backend="numpy"),
        case("zigzag_full_gqa", causal=False, nheads=4, nheads_kv=2, backend="numpy"),
        case("zigzag_window", causal=False, window=(4, 1), backend="numpy"),
        case("contiguous_window", layout="contiguous", causal=False, window=(2, 7),
             backend="numpy", seqlen=24)],
}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    """run(world): every case of one world size, run by `world` worker processes once for the
    module (an indirectly parametrized fixture was set up again for each test)."""
    done = {}

    def run(world):
        if world not in done:
            done[world] = _run_world(world, tmp_path_factory)
        return done[world]
    return run


def _run_world(world, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"ring{world}")
    rng = np.random.default_rng()
    inputs = {}
    for c in CASES[world]:
        q, k, v = random_qkv(rng, 1, c["seqlen"], c["seqlen"], c["nheads"], 8, "float32")
        k, v = k[:, :, :c["nheads_kv"]].copy(), v[:, :, :c["nheads_kv"]].copy()
        for name, x in zip("qkv", (q, k, v)):
            inputs[f"{c['name']}/{name}"] = x
        inputs[f"{c['name']}/dout"] = rng.standard_normal(q.shape).astype(np.float32)
    np.savez(directory / "inputs.npz", **inputs)
    (directory / "cases.json").write_text(json.dumps(CASES[world]))
    port = _free_port()
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", OMP_NUM_THREADS="1")
    workers = [subprocess.Popen([sys.executable, WORKER, str(directory), str(rank), str(world),
                                 str(port)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
               for rank in range(world)]
    logs = [w.communicate(timeout=900)[0] for w in workers]
    for rank, (w, log) in enumerate(zip(workers, logs)):
        assert w.returncode == 0, f"rank {rank} of {world} failed:\n{log[-4000:]}"
    errors = [json.loads((directory / f"errors_{r}.json").read_text()) for r in range(world)]
    return world, inputs, dict(np.load(directory / "results.npz")), errors


def _rounded(x, dtype):
    return x.astype(dtype).astype(np.float32)


@pytest.mark.parametrize("world, index", [(world, i) for world in sorted(CASES)
                                          for i in range(len(CASES[world]))],
                         ids=[f"world{w}-{c['name']}" for w in sorted(CASES) for c in CASES[w]])
def test_ring_matches_whole_sequence_attention(ring_runs, world, index):
    world, inputs, results, _ = ring_runs(world)
    c = CASES[world][index]
    dtype = c["dtype"]
    q, k, v, dout = (_rounded(inputs[f"{c['name']}/{x}"], dtype) for x in ("q", "k", "v", "dout"))
    spec = make_spec(q, k, causal=c["causal"], window_size=tuple(c["window"]),
                     softcap=c["softcap"])
    ref_out, ref_lse = attention_forward(np, q, k, v, spec, np.float64)
    base_type = np.float32 if dtype == "float32" else np.float16
    base_out, base_lse = attention_forward(np, q, k, v, spec, base_type)
    assert_within_rule("out", results[f"{c['name']}/out"], base_out, ref_out, dtype)
    refs = attention_backward(np, dout, q, k, v, ref_out, ref_lse, spec, np.float64)
    bases = attention_backward(np, dout.astype(base_type), q.astype(base_type),
                               k.astype(base_type), v.astype(base_type),
                               base_out.astype(base_type), base_lse.astype(np.float32), spec,
                               base_type)
    for name, ref, base in zip(("dq", "dk", "dv"), refs, bases):
        got = results[f"{c['name']}/{name}"]
        assert got.shape == ref.shape
        assert_within_rule(name, got, base, ref, dtype)


REFUSALS = {
    "unknown_layout": "layout must be one of",
    "layout_on_one_rank": "rank 1: layout must be one of",
    "shapes_differ": "q's shape differs",
    "odd_zigzag_shard": "must be even",
    "causal_differs": "the options differs",
    "bad_heads_on_one_rank": "nheads",
    "shard_indivisible": "multiple of",
}


@pytest.mark.parametrize("world", sorted(CASES), ids=lambda w: f"world{w}")
def test_bad_calls_are_refused_on_every_rank(ring_runs, world):
    world, _, _, errors = ring_runs(world)
    for rank, raised in enumerate(errors):
        for name, fragment in REFUSALS.items():
            assert raised[name] is not None and fragment in raised[name], (rank, name,
                                                                           raised[name])
        assert raised["works_after_errors"] is True


def test_ring_needs_an_initialised_group():
    import numba_flash.torch as nft
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        nft.ring_attention(q, q, q)
    with pytest.raises(RuntimeError, match="process group"):
        nft.shard_sequence(q)
