"""Where the host's time of a training step goes (bench_train.py's model and step).

For each attention: the step's time on the GPU's clock (CUDA events) and on the host's (the
time to issue one step, the stream drained before it, not after), the host time of the
attention function transformers calls per layer and of its backward node (on autograd's
thread), and, for numba_flash, of its forward and backward calls (numba_flash.api); the
synchronisations torch reports during one step (torch.cuda.set_sync_debug_mode); with
--profile, cProfile's top entries of numba_flash's forward and backward calls inside the
step; the garbage collections per step (and with --gc-off the step without them). Needs a
CUDA GPU, torch and transformers.

    python scripts/train_host.py [bench_train.py's model options] [--steps 5] [--profile]
                                 [--gc-off]
"""
import argparse
import cProfile
import collections
import gc
import pstats
import statistics
import sys
import time
import warnings

import bench_train

IMPLEMENTATIONS = ("numba_flash", "sdpa-flash")


class HostTimer:
    """Accumulated host seconds and calls of wrapped functions, by name; with a
    cProfile.Profile, the calls of functions wrapped with profiled=True are profiled too
    (not nested: one profiler is active at a time)."""

    def __init__(self, profile=None):
        self.seconds = collections.defaultdict(list)
        self.profile = profile
        self.profiled_calls = 0

    def wrap(self, name, fn, profiled=False):
        profiled = profiled and self.profile is not None

        def timed(*args, **kwargs):
            if profiled:
                self.profile.enable()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name].append(time.perf_counter() - start)
                if profiled:
                    self.profile.disable()
                    self.profiled_calls += 1
        return timed

    def report(self, steps):
        for name, seconds in self.seconds.items():
            us = sorted(1e6 * s for s in seconds)
            print(f"    {name:38s} us per call: median {statistics.median(us):7.1f}, mean "
                  f"{statistics.mean(us):7.1f}, max {us[-1]:8.1f}; {len(us) // steps} calls, "
                  f"{1e-3 * sum(us) / steps:6.2f} ms per step")


def issue_ms(torch, step, steps):
    """Median ms the host takes to issue one step, the stream drained before each."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - start))
    torch.cuda.synchronize()
    return statistics.median(times)


def gc_collections(step):
    """How many collections of each generation Python's garbage collector ran in one step."""
    counts = collections.Counter()

    def count(phase, info):
        if phase == "start":
            counts[info["generation"]] += 1
    gc.callbacks.append(count)
    try:
        step()
    finally:
        gc.callbacks.remove(count)
    return dict(sorted(counts.items()))


def torch_syncs(torch, step):
    """The synchronisations torch reports during one step (their first lines)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [str(w.message).splitlines()[0] for w in caught]


#: the autograd nodes of the attention itself (SDPA's backends, ours), by name
ATTENTION_NODES = ("ScaledDotProduct", "FlashAttentionFunction")


def time_backward_node(timer, name, output):
    """Time, on autograd's thread, the backward node of the attention that made `output`
    (found among the few nodes transformers puts after it: transposes, a copy)."""
    nodes = [output.grad_fn]
    for _ in range(6):
        node = next((n for n in nodes if n is not None
                     and any(a in n.name() for a in ATTENTION_NODES)), None)
        if node is not None:
            break
        nodes = [n for parent in nodes if parent is not None
                 for n, _ in parent.next_functions]
    else:
        return
    started = []
    node.register_prehook(lambda grads: started.append(time.perf_counter()))
    node.register_hook(lambda inputs, outputs: timer.seconds[name].append(
        time.perf_counter() - started.pop()))


def wrap_attention(transformers, implementation, timer):
    """Time the attention function transformers calls per layer and its backward node; for
    numba_flash also its forward and backward (numba_flash.torch calls them as api.forward /
    api.backward)."""
    interface = transformers.AttentionInterface
    name = implementation.split("-")[0]
    function = timer.wrap(f"{name} attention function", interface._global_mapping[name])

    def timed(*args, **kwargs):
        output, weights = function(*args, **kwargs)
        if output.requires_grad:
            time_backward_node(timer, f"{name} attention's backward node", output)
        return output, weights
    interface.register(name, timed)
    if name == "numba_flash":
        from numba_flash import api
        api.forward = timer.wrap("numba_flash.api.forward", api.forward, profiled=True)
        api.backward = timer.wrap("numba_flash.api.backward", api.backward, profiled=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_train.model_options(parser, steps=5)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile numba_flash's forward and backward calls in the step")
    parser.add_argument("--gc-off", action="store_true",
                        help="also time the step with Python's garbage collector off")
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS),
                        choices=bench_train.IMPLEMENTATIONS)
    args = parser.parse_args(argv)
    libraries = bench_train.set_up("train_host.py", args)
    if libraries is None:
        return 2
    torch, transformers = libraries
    for implementation in args.implementations:
        model = bench_train.build(transformers, torch, args, implementation)
        with bench_train.sdpa_backend(torch, implementation):
            step, _ = bench_train.prepared_step(torch, model, args)
            gpu = bench_train.event_ms(torch, step, args.steps)
            host = issue_ms(torch, step, args.steps)
            syncs = torch_syncs(torch, step)
            print(f"\n== {implementation}: {gpu:.1f} ms per step (CUDA events), {host:.1f} ms "
                  f"to issue one step (host); {len(syncs)} synchronisations torch reports per "
                  f"step", flush=True)
            for line, count in collections.Counter(syncs).most_common(5):
                print(f"    sync x{count}: {line[:150]}")
            collections_per_step = gc_collections(step)
            print(f"    garbage collections per step, by generation: {collections_per_step}")
            if args.gc_off:
                gc.disable()
                host_off = issue_ms(torch, step, args.steps)
                gpu_off = bench_train.event_ms(torch, step, args.steps)
                gc.enable()
                print(f"    with the garbage collector off: {host_off:.1f} ms to issue one "
                      f"step, {gpu_off:.1f} ms per step (CUDA events)")
            profiled = args.profile and implementation == "numba_flash"
            timer = HostTimer(cProfile.Profile() if profiled else None)
            wrap_attention(transformers, implementation, timer)
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        timer.report(args.steps)
        if timer.profiled_calls:
            print(f"  cProfile of numba_flash's calls over {args.steps} steps (internal time)")
            pstats.Stats(timer.profile, stream=sys.stdout).sort_stats("tottime").print_stats(30)
        del model, step
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
