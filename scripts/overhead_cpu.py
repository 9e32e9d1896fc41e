"""The Python side of a replayed call, measured on a machine without a GPU.

A proxy for overhead.py's host-only rows where no GPU is at hand: torch CPU tensors stand in
for CUDA ones (torch.Tensor.is_cuda reads True), the driver calls are stubbed (the launch, the
current-device and current-stream queries, the device's ordinal), and each call's replay is
built (replay.build_replay) from a record made by hand of the allocations and launches the
Hopper engine records for it (the forward: out and lse, one launch; the backward: dq, dk, dv
and the row sums, three launches), so that any tree with build_replay runs it (a tree on
PYTHONPATH, from this folder: compare trees here). What remains is our
Python on the path of a repeated call: the public function, the spec, the signature, the call
cache, the allocations (torch.empty on the CPU), the pointers and the parameter packing.
Rows: api.forward and api.backward at a training model's layout (bfloat16 views of (B, H, N,
D) tensors, GQA 4:1, requiring grad), numba_flash.torch.attention forward + backward, and
transformers' attention function with our forward. Times in microseconds, median of rounds;
the C work of a real call (cuLaunchKernel, the CUDA caching allocator) is not in them, so
compare trees with it, not with a GPU's numbers.

    python scripts/overhead_cpu.py [--calls 3000] [--rounds 5] [--profile [ROW]]
"""
import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # (numba without a GPU; nothing launches)


def stub_the_gpu(torch):
    """CPU tensors read as CUDA ones, and no driver call reaches a driver."""
    from numba_flash import _arrays
    from numba_flash.backends.numba import backend, launch
    torch.Tensor.is_cuda = property(lambda self: True)
    backend.simulator_enabled = lambda: False
    launch.current_device = lambda: -1  # (a CPU tensor's get_device(): on that device already)
    launch._driver_launch = lambda *args: None
    _arrays._torch_current_stream = lambda: (lambda device: 7)
    torch._C._cuda_getCurrentRawStream = lambda device: 7  # (where a tree asks torch directly)
    _arrays.device_id = lambda x: -1  # (a CPU tensor has no device index to read)


def recorded_replays(torch, q, k, v, dout):
    """Put in the call cache the replays the Hopper engine records for these calls; return
    the forward's out and lse (the backward's inputs)."""
    from numba_flash import call_cache
    from numba_flash.backends.numba import launch, replay
    from numba_flash.registry import get_backend
    from numba_flash.spec import make_spec
    backend, spec = get_backend("numba"), make_spec(q, k, causal=True)
    (batch, seqlen, heads, head_dim), heads_kv = q.shape, k.shape[2]

    def recorded(inputs, allocations, launches, results, ref):
        """build_replay of a record: allocations (shape, dtype), launches as the positions of
        their arrays among inputs + allocations, results likewise."""
        record = replay.Recording()
        made = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in allocations]
        record.allocations = [(*allocation, x) for allocation, x in zip(allocations, made)]
        arrays = [*inputs, *made]
        for roles in launches:  # (a kernel of 120 parameter slots, an address every 13th)
            prepared = launch.PreparedLaunch(0, (32, heads, batch), (384,), 200_000, [0] * 120,
                                             [4 + 13 * i for i in range(len(roles))])
            record.launches.append((prepared, [arrays[r].data_ptr() for r in roles]))
        built = replay.build_replay(backend, record, inputs, [arrays[r] for r in results], ref)
        assert built is not None
        return built, [arrays[r] for r in results]
    forward, (out, lse) = recorded((q, k, v), [((batch, seqlen, heads, head_dim), "bfloat16"),
                                               ((batch, heads, seqlen), "float32")],
                                   [(0, 1, 2, 3, 4)], (3, 4), 0)
    call_cache.put(call_cache.signature("forward", "auto", spec, (q, k, v)), forward)
    kv_shape = (batch, seqlen, heads_kv, head_dim)
    backward, _ = recorded((dout, q, k, v, out, lse),
                           [((batch, seqlen, heads, head_dim), "bfloat16"),
                            (kv_shape, "bfloat16"), (kv_shape, "bfloat16"),
                            ((batch, heads, seqlen), "float32")],
                           [(0, 4, 9), (0, 1, 2, 3, 5, 9, 7, 8), (0, 1, 2, 3, 5, 9, 6)],
                           (6, 7, 8), 1)
    call_cache.put(call_cache.signature("backward", "auto", spec, (dout, q, k, v, out, lse)),
                   backward)
    return out, lse


def median_us(fn, calls, rounds):
    result = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        result.append(1e6 * (time.perf_counter() - start) / calls)
    return statistics.median(result)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", nargs="?", const="api.forward", metavar="ROW",
                        help="cProfile of a row (default api.forward)")
    args = parser.parse_args(argv)
    import torch

    import numba_flash
    import numba_flash.torch as numba_torch
    from numba_flash.backends.numba import replay
    stub_the_gpu(torch)
    # (a short sequence: the host's work per call does not depend on it, and CPU allocations
    # of a real length would time malloc, which the GPU's caching allocator does not pay)
    batch, seqlen, heads, heads_kv, head_dim = 1, 16, 16, 4, 64
    q, k, v = (torch.randn(batch, h, seqlen, head_dim, dtype=torch.bfloat16,
                           requires_grad=True).transpose(1, 2) for h in (heads, heads_kv, heads_kv))
    dout = torch.randn(batch, seqlen, heads, head_dim, dtype=torch.bfloat16)
    out, lse = recorded_replays(torch, q, k, v, dout)
    counted = {"calls": 0}  # (every timed call must be a replay: the replays are counted)
    replay_call = replay.Replay.__call__

    def counting_call(self, *inputs):
        counted["calls"] += 1
        return replay_call(self, *inputs)
    replay.Replay.__call__ = counting_call
    rows = {
        "api.forward": lambda: numba_flash.forward(q, k, v, causal=True),
        "api.backward": lambda: numba_flash.backward(dout, q, k, v, out, lse, causal=True),
        "torch.attention forward + backward": lambda: numba_torch.attention(
            q, k, v, causal=True).backward(dout),
    }
    try:
        import transformers

        import numba_flash.integrations.transformers as numba_transformers
        numba_transformers.register()
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=heads * head_dim, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads_kv,
            attn_implementation="numba_flash")
        module = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].self_attn
        position_ids = torch.arange(seqlen)[None]
        layer = [x.transpose(1, 2) for x in (q, k, v)]
        rows["transformers attention function"] = lambda: numba_transformers.attention_forward(
            module, *layer, None, dropout=0.0, scaling=head_dim ** -0.5,
            position_ids=position_ids)
    except ImportError:
        print("transformers not installed: its row left out")
    print(f"B{batch} N{seqlen} H{heads}/{heads_kv} D{head_dim} bfloat16 views, causal; driver "
          f"calls stubbed; median of {args.rounds} rounds of {args.calls} calls")
    for name, fn in rows.items():
        before = counted["calls"]
        us = median_us(fn, args.calls, args.rounds)
        if counted["calls"] - before < args.calls:
            sys.exit(f"{name}: not every call was a replay (the stubs no longer match the code)")
        print(f"{name:36s} {us:8.1f} us per call")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [rows[args.profile]() for _ in range(args.calls)])
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
