"""Write the interactive explainer of the online softmax and of HBM traffic (and its figures).

    python scripts/explain.py --out DIR [--seed 0] [--figures docs]

DIR/online_softmax.html is one self-contained page (inline script and style, no network):
panel 1 steps the online softmax of one query row over four key blocks, with the numbers
computed here by numba_flash.reference.online_softmax_steps and embedded as data (the page
only displays them); panel 2 sets the HBM bytes standard attention moves against
FlashAttention's tiled reads, for a head dim and an SRAM size, beside the peak extra memory
of our forward and of the cupy backend measured on the H200 (a bench.py JSON).
--figures DIR also writes the same two pictures as PNGs (matplotlib).
"""
import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from numba_flash.reference import online_softmax_steps

BLOCK_SIZES = (2, 4, 8, 16)
VALUE_DIM = 3
BYTES = 2  # float16
MEMORY_JSON = Path(__file__).resolve().parents[1] / "docs" / "runs" / "bench_2026-12-01.json"
SEQLENS = [2 ** p for p in range(8, 18)]


def softmax_data(seed):
    """Per block size: one row of 4·block scaled scores and values, its online-softmax steps
    and the exact softmax · V."""
    rng = np.random.default_rng(seed)
    cases = {}
    for block in BLOCK_SIZES:
        scores = rng.standard_normal(4 * block) * 2.0
        values = rng.standard_normal((4 * block, VALUE_DIM))
        weights = np.exp(scores - scores.max())
        exact = (weights / weights.sum()) @ values
        steps = online_softmax_steps(scores, values, block)
        error = float(np.abs(np.array(steps[-1]["out"]) - exact).max())
        digits = 16 if error == 0 else int(math.floor(-math.log10(error)))
        cases[str(block)] = dict(values=values.tolist(), steps=steps, exact=exact.tolist(),
                                 digits=digits)
    return cases


def standard_bytes(n, d):
    """Standard attention per (batch, head): read Q, K and write S; read S, write P; read P and
    V, write O: (4·N·d + 4·N²) elements."""
    return BYTES * (4 * n * d + 4 * n * n)


def flash_bytes(n, d, sram_bytes):
    """FlashAttention (FA2's order) per (batch, head): Q read and O written once, K and V read
    once per query tile, whose Br rows (with a K and a V tile of as many rows) fill the SRAM."""
    rows = max(1, sram_bytes // (3 * d * BYTES))
    return BYTES * (2 * n * d + 2 * n * d * math.ceil(n / rows))


def traffic_data(memory_json):
    """HBM bytes against N for head dims 64 and 128 and two SRAM sizes, and the measured peak
    extra memory (MiB) of numba and cupy float16 forwards (B·N = 16k tokens) from bench.py."""
    sram = {"100 KiB (a block's shared memory)": 100 * 1024, "228 KiB (an H200 SM)": 228 * 1024}
    model = {str(d): {"standard": [standard_bytes(n, d) for n in SEQLENS],
                      **{name: [flash_bytes(n, d, size) for n in SEQLENS]
                         for name, size in sram.items()}} for d in (64, 128)}
    measured = {}
    rows = json.loads(Path(memory_json).read_text())["rows"] if memory_json else []
    for row in rows:
        if row["dtype"] != "float16" or row["passes"] != "fwd":
            continue
        for name in ("numba", "cupy"):
            mib = (row["results"].get(name) or {}).get("peak_extra_mib")
            if isinstance(mib, (int, float)):
                measured.setdefault(str(row["headdim"]), {}).setdefault(name, []).append(
                    [row["seqlen"], mib, row["batch"], row["nheads"]])
    return dict(seqlens=SEQLENS, model=model, sram=list(sram), measured=measured,
                source=Path(memory_json).name if memory_json else None)


def write_page(out_dir, seed, memory_json):
    data = dict(seed=seed, softmax=softmax_data(seed), traffic=traffic_data(memory_json))
    page = PAGE.replace("__DATA__", json.dumps(data).replace("</", "<\\/"))
    path = Path(out_dir) / "online_softmax.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path, data


def write_figures(fig_dir, data):
    """docs' PNGs of both panels (matplotlib, imported only here)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig_dir = Path(fig_dir)
    case = data["softmax"]["4"]
    steps = case["steps"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = range(1, len(steps) + 1)
    left.plot(x, [s["m"] for s in steps], "o-", label="running max m")
    left.plot(x, [s["l"] for s in steps], "s-", label="normaliser ℓ")
    left.plot(x, [s["rescale"] for s in steps], "^--", label="rescale exp(m_old − m_new)")
    left.set_xlabel("key blocks seen")
    left.set_xticks(list(x))
    left.legend(fontsize=8)
    left.set_title("the row's running statistics")
    for c in range(VALUE_DIM):
        line, = right.plot(x, [s["out"][c] for s in steps], "o-", label=f"out[{c}] = acc / ℓ")
        right.axhline(case["exact"][c], color=line.get_color(), ls=":", lw=1)
    right.set_xlabel("key blocks seen")
    right.set_xticks(list(x))
    right.set_title(f"output → exact softmax·V (dotted), {case['digits']} digits")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(fig_dir / "online_softmax.png", dpi=120)
    plt.close(fig)

    traffic = data["traffic"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for d, style in (("64", "-"), ("128", "--")):
        model = traffic["model"][d]
        left.loglog(traffic["seqlens"], model["standard"], "k" + style, label=f"standard, d={d}")
        for name, color in zip(traffic["sram"], ("tab:blue", "tab:green")):
            left.loglog(traffic["seqlens"], model[name], style, color=color,
                        label=f"FlashAttention, SRAM {name.split(' (')[0]}, d={d}")
    left.set_xlabel("sequence length N")
    left.set_ylabel("HBM bytes per (batch, head)")
    left.set_title("HBM traffic (model, float16)")
    left.legend(fontsize=7)
    for d, marker in (("64", "o"), ("128", "s")):
        for name, color in (("numba", "tab:blue"), ("cupy", "tab:red")):
            points = traffic["measured"].get(d, {}).get(name, [])
            if points:
                right.loglog([p[0] for p in points], [p[1] for p in points], marker + "-",
                             color=color, label=f"{name}, d={d}")
    right.set_xlabel("sequence length N (B·N = 16384)")
    right.set_ylabel("peak extra MiB")
    right.set_title(f"measured on the H200 ({traffic['source']})")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(fig_dir / "hbm_traffic.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for online_softmax.html")
    parser.add_argument("--seed", type=int, default=0, help="the scores' and values' seed")
    parser.add_argument("--memory-json", default=str(MEMORY_JSON),
                        help="a bench.py JSON with peak_extra_mib (default: the H200 run)")
    parser.add_argument("--figures", help="also write the PNGs into this folder")
    args = parser.parse_args(argv)
    path, data = write_page(args.out, args.seed, args.memory_json)
    print(f"wrote {path}")
    if args.figures:
        write_figures(args.figures, data)
        print(f"wrote {Path(args.figures) / 'online_softmax.png'} and hbm_traffic.png")
    return 0


PAGE = (Path(__file__).resolve().parent / "explain_page.html").read_text()

if __name__ == "__main__":
    sys.exit(main())
