"""The variants on one GPU, beside dense attention and the peers that take them.

Rows (float16 unless --dtype, head dim 128, B·N = --tokens, causal unless said): multi-head
attention with --heads heads (the reference row); GQA with --kv-heads key/value heads, beside
torch SDPA with enable_gqa=True (flash, cudnn, efficient: those that take it); a sliding
window of --window keys; softcap --softcap; ALiBi (the usual geometric slopes); varlen,
--documents packed causal sequences of random lengths (seeded) making up one sequence of
--seqlen tokens, the same packed as equal documents of the mean length, beside dense causal
attention on a batch of --documents sequences of that length (the same tokens, no packing:
what varlen's own cost is, apart from its lengths), and the equal documents again with their
cu_seqlens on the host (no wait for a read-back from the GPU); attention masks without causal (a
boolean (B, 1, 1, N) key padding mask keeping every key, a float (N, N) bias in the dtype),
beside torch SDPA with the same attn_mask (efficient, cudnn); mask_mods through a block mask:
the documents of the varlen row as a causal document mask over one sequence, the window as
a mask_mod beside causal, and the document mask with softcap (--flex: FlexAttention with the
same masks). TFLOP/s are counted over the visible
(unmasked) pairs only (forward 4·D FLOPs a pair, backward 2.5× that), so a row that skips
its masked tiles scores like dense attention; each row also gives its time against the
causal MHA row and the share of causal MHA's visible pairs it has. Timing as
scripts/bench.py (CUDA events, median, the implementations of a row taking turns).

    python scripts/bench_variants.py [--seqlen 16384] [--passes fwd fwdbwd] [--warm-only] [--flex]
                                    [--rows WORD...]
"""
import argparse
import sys

import numpy as np

import bench
import harness


def visible_pairs(seqlen_q, seqlen_k, causal, window):
    """How many (query, key) pairs are unmasked (bottom-right aligned, as the API)."""
    left, right = window
    right = 0 if causal else right
    diagonal = np.arange(seqlen_q) + (seqlen_k - seqlen_q)
    first = np.zeros(seqlen_q) if left < 0 else np.maximum(0, diagonal - left)
    last = (np.full(seqlen_q, seqlen_k - 1) if right < 0
            else np.minimum(seqlen_k - 1, diagonal + right))
    return float(np.maximum(0, last - first + 1).sum())


def document_lengths(seqlen, documents, seed=0):
    """`documents` random lengths (each at least 1/4 of the mean) summing to seqlen."""
    rng = np.random.default_rng(seed)
    shares = rng.uniform(0.25, 1.75, documents)
    lengths = np.maximum(1, np.round(shares / shares.sum() * seqlen)).astype(int)
    lengths[-1] = seqlen - lengths[:-1].sum()
    return [int(n) for n in lengths]


def alibi_slopes(heads):
    """The ALiBi paper's slopes for a power-of-two number of heads: 2^(-8 (h + 1) / heads)."""
    return (2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)).astype(np.float32)


def rows(args):
    """(name, kv_heads, options, torch peers); options "alibi" (slopes made per row),
    "lengths" (varlen; "host_offsets": its cu_seqlens as NumPy arrays), "mask" (with_mask),
    "as_mask_mod" (the row's window or documents written as a mask_mod for numba_flash, with
    a block mask: with_mask_mod) and "shape"
    ((batch, seqlen) of a row not of the bench's) are the bench's own."""
    sdpa = ("flash", "cudnn", "efficient")
    mean_length = args.seqlen // args.documents
    return [("mha causal", args.heads, dict(causal=True), sdpa),
            (f"gqa {args.heads}/{args.kv_heads} causal", args.kv_heads, dict(causal=True), sdpa),
            (f"window {args.window} causal", args.heads,
             dict(causal=True, window_size=(args.window, 0)), ()),
            (f"softcap {args.softcap:g} causal", args.heads,
             dict(causal=True, softcap=args.softcap), ()),
            ("alibi causal", args.heads, dict(causal=True, alibi=True), ()),
            (f"varlen {args.documents} docs causal", args.heads,
             dict(causal=True, lengths=document_lengths(args.seqlen, args.documents)), ()),
            (f"varlen {args.documents} equal docs causal", args.heads,
             dict(causal=True, lengths=[mean_length] * args.documents), ()),
            (f"varlen {args.documents} equal docs causal, host cu_seqlens", args.heads,
             dict(causal=True, lengths=[mean_length] * args.documents, host_offsets=True), ()),
            (f"B{args.documents} N{mean_length} causal", args.heads,
             dict(causal=True, shape=(args.documents, mean_length)), sdpa),
            ("padding mask, full", args.heads, dict(mask="padding"), sdpa[1:]),
            ("float bias, full", args.heads, dict(mask="bias"), sdpa[1:]),
            (f"mask_mod {args.documents} docs causal", args.heads,
             dict(causal=True, lengths=document_lengths(args.seqlen, args.documents),
                  as_mask_mod=True), ()),
            (f"mask_mod window {args.window}", args.heads,
             dict(causal=True, window_size=(args.window, 0), as_mask_mod=True), ()),
            (f"mask_mod docs softcap {args.softcap:g}", args.heads,
             dict(causal=True, lengths=document_lengths(args.seqlen, args.documents),
                  softcap=args.softcap, as_mask_mod=True), ())]


def row_pairs(seqlen, options):
    """The visible pairs of one sequence of a row (varlen: of its documents)."""
    causal, window = options.get("causal", False), options.get("window_size", (-1, -1))
    return sum(visible_pairs(n, n, causal, window)
               for n in options.get("lengths", [seqlen]))


def our_call(numba_flash, cp, options, heads):
    """(forward(q, k, v), backward(dout, q, k, v, out, lse)) of a row on (batch, N, H, D)
    arrays (varlen: the batch's one sequence as the packed documents)."""
    options = dict(options)
    options.pop("shape", None)
    lengths = options.pop("lengths", None)
    if options.pop("alibi", False):
        options["alibi_slopes"] = cp.asarray(alibi_slopes(heads))
    if lengths is None:
        return (lambda q, k, v: numba_flash.forward(q, k, v, **options),
                lambda *a: numba_flash.backward(*a, **options))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    if not options.pop("host_offsets", False):  # (on the host: checked without a read-back)
        cu = cp.asarray(cu)
    varlen = (cu, cu, max(lengths), max(lengths))
    return (lambda q, k, v: numba_flash.forward_varlen(q[0], k[0], v[0], *varlen, **options),
            lambda dout, q, k, v, out, lse: numba_flash.backward_varlen(
                dout[0], q[0], k[0], v[0], out, lse, *varlen, **options))


def with_mask_mod(numba_flash, cp, options, seqlen):
    """A row's options for numba_flash with its window or documents as a mask_mod (over a
    device array of document ids), passed as a block mask (built by the first call)."""
    options = dict(options)
    if not options.pop("as_mask_mod", False):
        return options
    lengths = options.pop("lengths", None)
    left, _ = options.pop("window_size", (-1, -1))
    if lengths is not None:
        ids = cp.asarray(np.repeat(np.arange(len(lengths)), lengths), cp.int32)

        def mask_mod(b, h, q_idx, kv_idx):
            return ids[q_idx] == ids[kv_idx]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx >= q_idx - left
    options["block_mask"] = numba_flash.block_mask(mask_mod, None, None, seqlen, seqlen)
    return options


def with_mask(cp, options, q):
    """A row's options with its attn_mask made (for q's batch, length and dtype): "padding",
    a boolean (B, 1, 1, N) mask keeping every key (what reading a mask costs); "bias", a float
    (N, N) bias."""
    options = dict(options)
    kind = options.pop("mask", None)
    batch, seqlen = q.shape[:2]
    if kind == "padding":
        options["attn_mask"] = cp.ones((batch, 1, 1, seqlen), cp.bool_)
    elif kind == "bias":
        bias = cp.random.default_rng(0).standard_normal((seqlen, seqlen), cp.float32)
        options["attn_mask"] = (bias * 0.5).astype(q.dtype)
    return options


def runners(numba_flash, torch, inputs, options, passes, peers):
    """{name: fn(i)} for numba and the torch peers of a row."""
    import cupy as cp
    options = with_mask(cp, options, inputs[0][0])
    forward, backward = our_call(numba_flash, cp,
                                 with_mask_mod(numba_flash, cp, options, inputs[0][0].shape[1]),
                                 inputs[0][0].shape[2])
    options.pop("as_mask_mod", None)

    def ours(i):
        q, k, v, dout = inputs[i]
        out, lse = forward(q, k, v)
        if passes == "fwdbwd":
            backward(dout, q, k, v, out, lse)
    found = {"numba": ours}
    if torch is None or not peers:
        return found
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}
    views = [[torch.from_dlpack(x).transpose(1, 2) for x in arrays] for arrays in inputs]
    mask = options.get("attn_mask")
    mask = None if mask is None else torch.from_dlpack(mask)
    gqa = views[0][0].shape[1] != views[0][1].shape[1]
    for kind in peers:
        if kind == "flex":
            found["flex"] = flex_runner(torch, views, options, passes)
            continue

        def peer(i, kind=kind):
            q, k, v, dout = views[i]
            with sdpa_kernel(kinds[kind]):
                if passes == "fwdbwd":
                    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=options.get("causal", False),
                    enable_gqa=gqa)
                if passes == "fwdbwd":
                    out.backward(dout)
        found[f"sdpa-{kind}"] = peer
    return found


def flex_runner(torch, views, options, passes):
    """fn(i): torch FlexAttention (torch.compile'd) on the row's inputs i, with the row's
    masks and score mods (flex_peer.py)."""
    from flex_peer import flex_attention_call
    if "attn_mask" in options:  # (a mask array is not a mask_mod: no FlexAttention peer;
        #                          main reports the row's flex as skipped)
        def unsupported(i):
            raise NotImplementedError("FlexAttention takes no attn_mask array here")
        return unsupported
    q = views[0][0]
    slopes = (torch.tensor(alibi_slopes(q.shape[1]), device=q.device)
              if options.get("alibi") else None)
    call = flex_attention_call(torch, options, q.shape[2], q.device, slopes,
                               options.get("lengths"))

    def run(i):
        q, k, v, dout = views[i]
        if passes == "fwdbwd":
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = call(q, k, v)
        if passes == "fwdbwd":
            out.backward(dout)
    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--softcap", type=float, default=30.0)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--passes", nargs="+", default=["fwd", "fwdbwd"],
                        choices=["fwd", "fwdbwd"])
    parser.add_argument("--no-torch", action="store_true", help="leave torch SDPA out")
    parser.add_argument("--flex", action="store_true",
                        help="time torch FlexAttention (torch.compile'd) beside every row")
    parser.add_argument("--warm-only", action="store_true",
                        help="one call of each row (compiles the kernels), nothing timed")
    parser.add_argument("--rows", nargs="+", metavar="WORD",
                        help="only the rows whose name holds one of these (and the reference row)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--lock", metavar="PATH",
                        help="time each row holding this lock file (harness.gpu_turn), so that "
                             "benches of two trees compile side by side and time in turns")
    args = parser.parse_args(argv)
    reason = harness.gpu_ready()
    if reason:
        print(f"bench_variants.py needs a CUDA GPU and CuPy ({reason})")
        return 2
    import cupy as cp

    import numba_flash
    torch = harness.optional_torch(args.no_torch)
    batch = max(1, args.tokens // args.seqlen)
    rng = np.random.default_rng(0)
    timer = bench.Timer(cp)
    results = []
    print(f"{args.dtype} d{args.head_dim} B{batch} N{args.seqlen} H{args.heads}; TFLOP/s over "
          f"visible pairs")
    for passes in args.passes:
        reference_ms = reference_pairs = None
        for index, (name, kv_heads, options, peers) in enumerate(rows(args)):
            if index and args.rows and not any(word in name for word in args.rows):
                continue
            inputs = []
            row_batch, row_seqlen = options.get("shape", (batch, args.seqlen))
            for _ in range(1 if args.warm_only else 2):
                q, k, v, dout = harness.random_inputs(cp, rng, row_batch, row_seqlen, row_seqlen,
                                                      args.heads, args.head_dim, args.dtype)
                k, v = (cp.ascontiguousarray(x[:, :, :kv_heads]) for x in (k, v))
                inputs.append((q, k, v, dout))
            fns = runners(numba_flash, torch, inputs, options, passes,
                          peers + ("flex",) if args.flex else peers)
            ready = {}
            for label, fn in fns.items():
                try:
                    fn(0)
                    ready[label] = lambda i, fn=fn: fn(i % len(inputs))
                except Exception as exc:  # a peer that does not take this case
                    print(f"  {label}: skipped ({type(exc).__name__}: {str(exc)[:100]})")
            if args.warm_only:
                continue
            with harness.gpu_turn(args.lock):
                times = timer(ready)
            pairs = row_batch * args.heads * row_pairs(row_seqlen, options)
            work = 4.0 * args.head_dim * pairs * (3.5 if passes == "fwdbwd" else 1.0)
            if reference_ms is None:
                reference_ms, reference_pairs = times["numba"], pairs
            row = {"passes": passes, "row": name, "visible_share": pairs / reference_pairs,
                   "ms_over_mha_causal": times["numba"] / reference_ms}
            for label, ms in times.items():
                row[label] = ({"ms": ms, "tflops": work / ms / 1e9} if isinstance(ms, float)
                              else {"error": repr(ms)[:120]})
            results.append(row)
            cells = "  ".join(f"{label} {value['tflops']:.1f}" for label, value in row.items()
                              if isinstance(value, dict) and "tflops" in value)
            print(f"{passes:6s} {name:22s} {cells}  | time / mha causal "
                  f"{row['ms_over_mha_causal']:.3f}, visible pairs / mha causal "
                  f"{row['visible_share']:.3f}", flush=True)
            harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
