"""One rank of a ring_attention test run over gloo: `python ring_worker.py DIR RANK WORLD PORT`.

Reads DIR/cases.json and DIR/inputs.npz (the whole sequences, made by test_ring_gloo.py),
runs every case on its shards (forward, then backward of sum(out · dout)), gathers the output
and gradients, and (rank 0) writes DIR/results.npz; then tries the bad calls and writes what
each raised to DIR/errors_RANK.json. The kernels run in the CUDA simulator.
"""
import json
import os
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import numba_flash.torch as nft  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}


def run_case(case, inputs):
    dtype, layout = TORCH_DTYPES[case["dtype"]], case["layout"]
    whole = [torch.from_numpy(inputs[f"{case['name']}/{x}"]).to(dtype)
             for x in ("q", "k", "v", "dout")]
    q, k, v, dout = (nft.shard_sequence(x, layout=layout) for x in whole)
    for x in (q, k, v):
        x.requires_grad_(True)
    out = nft.ring_attention(q, k, v, causal=case["causal"], window_size=tuple(case["window"]),
                             softcap=case["softcap"], softmax_scale=case["scale"],
                             layout=layout, backend=case["backend"])
    (out.float() * dout.float()).sum().backward()
    return {f"{case['name']}/{name}": nft.unshard_sequence(x, layout=layout).float().numpy()
            for name, x in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


def bad_calls(rank, world):
    """name -> (q, k, v, keyword arguments) of calls every rank must refuse."""
    def shards(length, nheads=2):
        return [torch.randn(1, length, nheads, 8) for _ in range(3)]
    return {
        "unknown_layout": (*shards(4), dict(layout="striped")),
        "layout_on_one_rank": (*shards(4), dict(layout="striped" if rank == 1 else "zigzag")),
        "shapes_differ": (*shards(4 if rank == 0 else 6), dict(layout="zigzag")),
        "odd_zigzag_shard": (*shards(5), dict(layout="zigzag")),
        "causal_differs": (*shards(4), dict(layout="contiguous", causal=rank == 0)),
        "bad_heads_on_one_rank": (*shards(4, nheads=3 if rank == world - 1 else 2)[:1],
                                  *shards(4)[1:], dict(layout="zigzag")),
    }


def try_bad_calls(rank, world):
    raised = {}
    for name, (q, k, v, options) in bad_calls(rank, world).items():
        try:
            nft.ring_attention(q, k, v, backend="numpy", **options)
            raised[name] = None
        except (ValueError, TypeError, RuntimeError) as error:
            raised[name] = f"{type(error).__name__}: {error}"
    try:
        nft.shard_sequence(torch.randn(1, 2 * world + 1, 2, 8), layout="zigzag")
        raised["shard_indivisible"] = None
    except ValueError as error:
        raised["shard_indivisible"] = f"ValueError: {error}"
    return raised


def main():
    directory, rank, world, port = sys.argv[1], *(int(a) for a in sys.argv[2:5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    with open(os.path.join(directory, "cases.json")) as f:
        cases = json.load(f)
    inputs = np.load(os.path.join(directory, "inputs.npz"))
    results = {}
    for case in cases:
        results.update(run_case(case, inputs))
    raised = try_bad_calls(rank, world)
    # after the refused calls the ring still works: the first case again, bit for bit
    again = run_case(cases[0], inputs)
    raised["works_after_errors"] = all(np.array_equal(again[n], results[n]) for n in again)
    if rank == 0:
        np.savez(os.path.join(directory, "results.npz"), **results)
    with open(os.path.join(directory, f"errors_{rank}.json"), "w") as f:
        json.dump(raised, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
