"""The paper model of ring attention (numba_flash.torch.ring_attention) in docs/SCALING.md:
per ring step and GPU, the attention work of one (query shard, key/value shard) pair against
the bytes that travel to the next rank, for worlds of 2 to 64 GPUs.

    python scripts/scaling_model.py [--tokens 262144] [--heads 32] [--kv-heads 8] [--head-dim 128]

Per step, with S = tokens / world tokens per GPU, B = 1, 16-bit K/V:
  forward:  4·H·S²·D FLOPs (half under causal with the zigzag layout, every step alike)
            against K and V, 2·2·S·H_kv·D bytes;
  backward: 2.5x the forward's FLOPs against K and V (16-bit) and their float32 dK and dV,
            (2·2 + 2·4)·S·H_kv·D bytes.
A step hides its message when its compute takes at least as long as the message: the
shortest shard that does is S* = (bytes per token / FLOPs per token pair) · rate / bandwidth.
Rates are the kernels' own, measured on an H200 (docs/PERFORMANCE.md); bandwidths per GPU
and direction. Message latency (a few µs on NVLink, 10–20 on InfiniBand) is left out: it
matters only for shards far below S*.
"""
import argparse

#: attention TFLOP/s measured on the H200 (bfloat16, d128, N = 16384, 2026-12-02): the Hopper
#: forward; the backward on the mma.sync kernels (forward + backward 170 TFLOP/s causal at
#: d128 with the mma.sync forward, 2026-12-01: the backward alone about 150)
RATES = {"forward": 550e12, "backward": 150e12}
#: bytes per second per GPU and direction: NVLink 4 (H100/H200: 900 GB/s both directions
#: together) and one 400 Gb/s InfiniBand NIC per GPU
LINKS = {"NVLink": 450e9, "InfiniBand": 50e9}


def step(shard, heads, kv_heads, head_dim, causal, passes):
    """(FLOPs, bytes) of one ring step on one GPU."""
    flops = 4.0 * heads * shard * shard * head_dim / (2.0 if causal else 1.0)
    if passes == "backward":
        return 2.5 * flops, (2 * 2 + 2 * 4) * shard * kv_heads * head_dim
    return flops, 2 * 2 * shard * kv_heads * head_dim


def hidden_from(heads, kv_heads, head_dim, causal, passes, link):
    """The shortest shard (tokens per GPU) whose step compute hides its message."""
    flops_per_pair, bytes_per_token = step(1, heads, kv_heads, head_dim, causal, passes)
    return bytes_per_token * RATES[passes] / (flops_per_pair * LINKS[link])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=262144)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    print(f"{args.tokens} tokens, H {h}, H_kv {hkv}, D {d}; µs per ring step and GPU "
          f"(compute / NVLink / InfiniBand message)")
    print("| world | tokens per GPU | fwd full | fwd causal (zigzag) | bwd full | bwd causal |")
    print("|---|---|---|---|---|---|")
    for world in (2, 4, 8, 16, 32, 64):
        shard = args.tokens // world
        cells = []
        for passes in ("forward", "backward"):
            for causal in (False, True):
                flops, size = step(shard, h, hkv, d, causal, passes)
                cells.append(f"{flops / RATES[passes] * 1e6:.0f} / "
                             f"{size / LINKS['NVLink'] * 1e6:.1f} / "
                             f"{size / LINKS['InfiniBand'] * 1e6:.0f}")
        print(f"| {world} | {shard} | " + " | ".join(cells) + " |")
    print()
    print("| link | H_kv | fwd full | fwd causal | bwd full | bwd causal |")
    print("|---|---|---|---|---|---|")
    for link in LINKS:
        for kv in sorted({h, hkv}):
            cells = [f"{hidden_from(h, kv, d, causal, passes, link):.0f}"
                     for passes in ("forward", "backward") for causal in (False, True)]
            print(f"| {link} | {kv} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    main()
