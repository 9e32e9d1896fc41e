"""What the Hopper kernels share around their products: the producer's announcements of
landed tiles, the stage parities of the mbarrier pipelines, and the wgmma loops (a product
over the head dim from two K-major tiles; a product with A from registers and B MN-major).

A pipeline of `stages` buffers: use j of buffer j % stages waits on the buffer's `full`
mbarrier for parity full_parity(j) and frees it on its `empty` one; the producer waits on
`empty` for free_parity(j) before refilling (a fresh barrier passes parity 1 at once, so the
first pass over the buffers does not wait). A kernel's mbarriers (barrier_bytes): the tiles
it loads once, then the full barriers of each of its `groups` pipelines, then their empty
ones (full_barrier, empty_barrier give their byte offsets).
"""
import functools

from numba import cuda

from ..device.intrinsics import (cp_async_wait, descriptor_at, fence_mbarrier_init,
                                 fence_proxy_async, make_descriptor, make_wgmma,
                                 mbarrier_arrive, mbarrier_init)
from .config import WARPGROUP
from .layout import ATOM_BYTES, ROW_BYTES, k_step


def barrier_words(groups, stages):
    """8-byte mbarriers of a kernel with `groups` pipelines of `stages` buffers."""
    return 1 + 2 * groups * stages


def full_barrier(group, stage, stages):
    return 8 * (1 + group * stages + stage)


def empty_barrier(group, stage, stages, groups):
    return 8 * (1 + (groups + group) * stages + stage)


@functools.lru_cache(maxsize=None)
def make_barrier_init(groups, stages, empty_arrivals, full_arrivals=WARPGROUP):
    """init_barriers(bars) (one thread, before a block barrier): the once-loaded tiles' and
    every full barrier count `full_arrivals` (the producer's threads that copy with cp.async,
    or the one that issues the copy engine's copies); every empty one `empty_arrivals`
    arrivals (a thread of each consumer warpgroup, or of each consumer warp)."""
    @cuda.jit(device=True, inline="always")
    def init_barriers(bars):
        mbarrier_init(bars, full_arrivals)
        for group in range(groups):  # (full_barrier's and empty_barrier's offsets)
            for stage in range(stages):
                mbarrier_init(bars + 8 * (1 + group * stages + stage), full_arrivals)
                mbarrier_init(bars + 8 * (1 + (groups + group) * stages + stage),
                              empty_arrivals)
        fence_mbarrier_init()

    return init_barriers


@cuda.jit(device=True, inline="always")
def full_parity(j, stages):
    return (j // stages) % 2


@cuda.jit(device=True, inline="always")
def free_parity(j, stages):
    return (j // stages + 1) % 2


@cuda.jit(device=True, inline="always")
def announce_previous(barrier):
    """The producer thread's commit group before its newest has landed (cp.async groups
    complete in order): fence its writes for the async proxy (wgmma reads through it, and
    cp.async wrote through the generic one) and arrive on the group's full barrier."""
    cp_async_wait(1)
    fence_proxy_async()
    mbarrier_arrive(barrier)


@cuda.jit(device=True, inline="always")
def announce_all(barrier):
    """As announce_previous, for the thread's last group."""
    cp_async_wait(0)
    fence_proxy_async()
    mbarrier_arrive(barrier)


@functools.lru_cache(maxsize=None)
def make_score_products(n, bf16, head_dim, a_rows, b_rows):
    """products(acc, a_desc, b_desc): acc = A Bᵀ over the head dim for a warpgroup's 64 rows
    of A (a descriptor into a K-major tile of a_rows rows) and n rows of B (a K-major tile of
    b_rows rows), head_dim / 16 products m64nNk16 (S = Q Kᵀ; Sᵀ = K Qᵀ; dP = dO Vᵀ)."""
    product = make_wgmma(n, bf16)
    steps = head_dim // 16

    @cuda.jit(device=True, inline="always")
    def products(acc, a_desc, b_desc):
        for kk in range(steps):
            product(acc, descriptor_at(a_desc, k_step(kk, a_rows)),
                    descriptor_at(b_desc, k_step(kk, b_rows)), 1 if kk > 0 else 0)

    return products


@functools.lru_cache(maxsize=None)
def make_register_products(n, bf16, chunks, b_rows):
    """products(acc, a, b_tile): acc += A B for A the warpgroup's 64 x 16·chunks in
    registers (a[kc, 0..3]: wgmma's A fragments of chunk kc) and B the 16·chunks x n block at
    shared address b_tile of an MN-major tile of b_rows rows (O += P V; dV += Pᵀ dO; dK +=
    dSᵀ Q; dQ += dS K)."""
    product = make_wgmma(n, bf16, a_from_registers=True, b_mn_major=True)

    @cuda.jit(device=True, inline="always")
    def products(acc, a, b_tile):
        b_desc = make_descriptor(b_tile, b_rows * ROW_BYTES, ATOM_BYTES)
        for kc in range(chunks):
            product(acc, (a[kc, 0], a[kc, 1], a[kc, 2], a[kc, 3]),
                    descriptor_at(b_desc, 2 * ATOM_BYTES * kc), 1)

    return products
