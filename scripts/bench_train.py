"""Training throughput of a small Llama-style model (transformers) with each attention.

One process, the same random weights (no download) under each attn_implementation:
"numba_flash" (numba_flash.integrations.transformers), "sdpa" restricted to one SDPA backend
(flash, cudnn) and "eager". Tokens per second of forward + backward + AdamW step in bfloat16
(CUDA events around --steps steps after --warmup), and the peak memory torch allocated in
the warm-up steps beyond the weights (the optimizer's state, gradients, activations, and a
compiled model's CUDA-graph pool). Every model is built first; each of --rounds rounds then
times each model's steps in turn, and each model's speed is divided by sdpa-flash's (else
sdpa-cudnn's) of the same round: at batch 1 the step is bound by the host, whose speed
drifts, so the ratio of a round, not a lone figure, compares attentions. Needs a CUDA GPU,
torch and transformers.

    python scripts/bench_train.py [--layers 12] [--d-model 1024] [--heads 16] [--kv-heads 4]
                                  [--seqlen 4096] [--batch 1] [--rounds 5] [--json results.json]
                                  [--compile {default,reduce-overhead}]
"""
import argparse
import contextlib
import statistics
import sys

import harness

IMPLEMENTATIONS = ("numba_flash", "sdpa-flash", "sdpa-cudnn", "eager")
#: the peer each implementation's speed is divided by, round by round (the first one run)
CONTROLS = ("sdpa-flash", "sdpa-cudnn")


def build(transformers, torch, args, implementation):
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.d_model, intermediate_size=args.d_model * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.seqlen,
        attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation.split("-")[0])
    return model.to("cuda", torch.bfloat16).train()


def sdpa_backend(torch, implementation):
    """A context that restricts SDPA to one backend ("sdpa-flash", "sdpa-cudnn")."""
    if not implementation.startswith("sdpa-"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kind = {"flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}[implementation.split("-")[1]]
    return sdpa_kernel([kind])


def training_step(torch, model, ids, compile_mode=None):
    """One training step (forward, backward, a fused AdamW step) of model on ids, as a
    function; with compile_mode, through torch.compile(model, mode=compile_mode)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    run = model if compile_mode is None else torch.compile(model, mode=compile_mode)

    def step():
        if compile_mode == "reduce-overhead":  # (a new step: CUDA graphs may reuse its memory)
            torch.compiler.cudagraph_mark_step_begin()
        run(ids, labels=ids, use_cache=False).loss.backward()  # (training: no KV cache)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def event_ms(torch, step, steps):
    """ms per step on the GPU's clock: CUDA events around `steps` steps issued back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def prepared_step(torch, model, args, compile_mode=None):
    """(the training step of model on random tokens (training_step), warmed up: compiled with
    compile_mode if given; the peak GiB the warm-up steps allocated beyond what was allocated
    before them: the optimizer's state, gradients, activations and, with CUDA graphs, their
    memory pool, not the weights)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seqlen), device="cuda")
    step = training_step(torch, model, ids, compile_mode)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    return step, (torch.cuda.max_memory_allocated() - before) / 2**30


def positive(text):
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more; got {value}")
    return value


def model_options(parser, steps):
    """The model's and the timing's options (train_host.py takes them too)."""
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=3)


def set_up(script, args):
    """(torch, transformers) with "numba_flash" registered and the model described, or None
    (said) without a CUDA GPU."""
    import torch
    import transformers
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU")
        return None
    import numba_flash.integrations.transformers as numba_transformers
    numba_transformers.register()
    print(f"Llama-style: {args.layers} layers, d_model {args.d_model}, {args.heads} heads "
          f"({args.kv_heads} kv), seq {args.seqlen}, batch {args.batch}, bfloat16, AdamW")
    return torch, transformers


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_options(parser, steps=10)
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS),
                        choices=IMPLEMENTATIONS)
    parser.add_argument("--compile", choices=("default", "reduce-overhead"),
                        help="time torch.compile(model, mode=...) instead of eager (the warm-up "
                             "steps compile; reduce-overhead replays CUDA graphs, so the host's "
                             "Python is out of the step)")
    parser.add_argument("--rounds", type=positive, default=1,
                        help="time every implementation's steps this many times, in turns")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    libraries = set_up("bench_train.py", args)
    if libraries is None:
        return 2
    torch, transformers = libraries
    if args.compile:
        print(f"each model through torch.compile(mode={args.compile!r})")
    steps, results = {}, {}
    for implementation in args.implementations:
        model = build(transformers, torch, args, implementation)
        try:
            with sdpa_backend(torch, implementation):
                steps[implementation] = prepared_step(torch, model, args, args.compile)
        except Exception as exc:  # a peer that cannot run this configuration
            results[implementation] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            print(f"{implementation:12s} skipped ({results[implementation]['error']})")
            del model
            torch.cuda.empty_cache()
    # Every model stays built: each round times each one's steps in turn, so that a drift of
    # the host's speed (the step is bound by the host at batch 1) falls on all of them alike.
    rounds = {implementation: [] for implementation in steps}
    for number in range(args.rounds):
        for implementation, (step, peak) in list(steps.items()):
            try:
                with sdpa_backend(torch, implementation):
                    ms = event_ms(torch, step, args.steps)
            except Exception as exc:  # (out of memory with every model built, say)
                error = f"round {number + 1}: {type(exc).__name__}: {str(exc)[:200]}"
                print(f"{implementation:12s} dropped ({error})")
                results[implementation] = {"error": error}
                del steps[implementation], rounds[implementation]
                torch.cuda.empty_cache()
                continue
            rounds[implementation].append(ms)
            print(f"round {number + 1} {implementation:12s} "
                  f"{args.batch * args.seqlen / (ms / 1e3):10.0f} tokens/s  {ms:8.1f} ms/step",
                  flush=True)
    control = next((name for name in CONTROLS if name in rounds), None)
    against = f"; against {control} in each round" if control else ""
    print(f"\nmedian of {args.rounds} rounds{against}")
    for implementation, timings in rounds.items():
        ms = statistics.median(timings)
        peak = steps[implementation][1]
        results[implementation] = {
            "tokens_per_s": args.batch * args.seqlen / (ms / 1e3), "ms_per_step": ms,
            "ms_per_round": timings, "peak_gib_beyond_weights": peak}
        line = (f"{implementation:12s} {results[implementation]['tokens_per_s']:10.0f} "
                f"tokens/s  {ms:8.1f} ms/step  {peak:6.1f} GiB beyond the weights")
        if control:
            ratio = statistics.median(c / t for t, c in zip(timings, rounds[control]))
            results[implementation]["speed_vs_" + control] = ratio
            line += f"  {ratio:5.2f}x {control}"
        print(line)
    harness.write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
