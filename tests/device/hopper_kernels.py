"""Small kernels exercising the Hopper intrinsics (wgmma, mbarriers, cp.async to a shared
address, named barriers, setmaxnreg); used by test_hopper_intrinsics.py (simulator and GPU)
and compiled for sm_90a by its PTX test.

The tiles here are laid out by the test's own placement of the 128-byte swizzle
(swizzled_byte), written independently of the kernel family that uses it."""
from numba import cuda
from numba.core.types import float32, uint16, uint64

from numba_flash.backends.numba.hopper.turns import give_turn, open_turns, take_turn
from numba_flash.backends.numba.device.intrinsics import (
    cp_async_16_from, cp_async_commit, cp_async_wait, descriptor_at, fence_mbarrier_init,
    fence_proxy_async, global_address, make_descriptor, make_fence_operands, make_wgmma,
    mbarrier_arrive, mbarrier_init, mbarrier_wait, named_barrier_sync, setmaxnreg_dec,
    setmaxnreg_inc, shared_base, wgmma_commit, wgmma_fence, wgmma_wait)

D = 128  # columns of the scores kernel's operands (two 64-column blocks)
N = 64  # keys of the scores kernel, columns of P V's output
KEYS = 32  # P V's reduction length
ACC_SHAPE = (N // 8, 4)  # m64nNk16's float32 accumulator registers per thread
ALIGN = 1024


@cuda.jit(device=True, inline="always")
def swizzled_byte(row, col, rows):
    """Byte offset of element (row, col) of a 16-bit tile of `rows` rows stored as 64-column
    blocks of 128-byte rows, 16-byte chunk c of row r at chunk c ^ (r % 8)."""
    return ((col // 64) * rows * 128 + row * 128 + ((((col % 64) // 8) ^ (row % 8)) * 16)
            + (col % 8) * 2)


@cuda.jit(device=True, inline="always")
def store_accumulator(out, acc):
    """The warpgroup's 64 x N accumulator (wgmma's D layout) into out."""
    tid = cuda.threadIdx.x
    row, t = 16 * (tid // 32) + (tid % 32) // 4, tid % 4
    for j in range(N // 8):
        for r in range(4):
            out[row + 8 * (r // 2), 8 * j + 2 * t + r % 2] = acc[j, r]


def make_scores_kernel(bf16):
    """S = A Bᵀ for A (64, D) and B (N, D) (16-bit patterns), both K-major in shared memory:
    one warpgroup, D // 16 products m64nNk16 accumulating in registers."""
    wgmma = make_wgmma(N, bf16)
    fence = make_fence_operands(N // 2)

    def scores_kernel(a, b, out):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        base = shared_base(smem, ALIGN)
        origin = shared_base(smem, 1)  # (smem[i] is `origin + 2 i`)
        a_at, b_at = base, base + 64 * D * 2
        for e in range(tid, 64 * D, 128):
            smem[(a_at - origin + swizzled_byte(e // D, e % D, 64)) // 2] = a[e // D, e % D]
        for e in range(tid, N * D, 128):
            smem[(b_at - origin + swizzled_byte(e // D, e % D, N)) // 2] = b[e // D, e % D]
        fence_proxy_async()  # why: ordinary stores, read next by the async proxy (wgmma)
        cuda.syncthreads()  # why: the whole tile is stored before any product reads it

        acc = cuda.local.array(ACC_SHAPE, float32)
        desc_a = make_descriptor(a_at, 16, 1024)
        desc_b = make_descriptor(b_at, 16, 1024)
        fence(acc)
        wgmma_fence()
        for kk in range(D // 16):  # k16 steps: 32 bytes along a row, then the next block
            step = (kk // 4) * 128
            wgmma(acc, descriptor_at(desc_a, step * 64 + 32 * (kk % 4)),
                  descriptor_at(desc_b, step * N + 32 * (kk % 4)), kk > 0)
        wgmma_commit()
        wgmma_wait(0)
        fence(acc)
        store_accumulator(out, acc)

    scores_kernel.__name__ = scores_kernel.__qualname__ = f"scores_kernel_{int(bf16)}"
    return scores_kernel


def make_pv_kernel(bf16):
    """O = P V for P (64, KEYS) from registers (wgmma's A fragments) and V (KEYS, N) (16-bit
    patterns) MN-major in shared memory, as the forward's P V: KEYS // 16 products
    m64nNk16."""
    wgmma = make_wgmma(N, bf16, a_from_registers=True, b_mn_major=True)
    fence = make_fence_operands(N // 2)

    def pv_kernel(p_fragments, v, out):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        base = shared_base(smem, ALIGN)
        origin = shared_base(smem, 1)
        for e in range(tid, KEYS * N, 128):
            smem[(base - origin + swizzled_byte(e // N, e % N, KEYS)) // 2] = v[e // N, e % N]
        fence_proxy_async()  # why: ordinary stores, read next by the async proxy (wgmma)
        cuda.syncthreads()  # why: the whole tile is stored before any product reads it

        acc = cuda.local.array(ACC_SHAPE, float32)
        desc_v = make_descriptor(base, KEYS * 128, 1024)  # 64-column blocks; 8-key groups
        fence(acc)
        wgmma_fence()
        for kc in range(KEYS // 16):
            wgmma(acc, (p_fragments[kc, tid, 0], p_fragments[kc, tid, 1],
                        p_fragments[kc, tid, 2], p_fragments[kc, tid, 3]),
                  descriptor_at(desc_v, 2048 * kc), kc > 0)
        wgmma_commit()
        wgmma_wait(0)
        fence(acc)
        store_accumulator(out, acc)

    pv_kernel.__name__ = pv_kernel.__qualname__ = f"pv_kernel_{int(bf16)}"
    return pv_kernel


def late_operand_kernel(a, b, b_later, acc_before_wait, out):
    """Simulator only (on a GPU this is a race): one product S = A Bᵀ (the first k16 step of
    make_scores_kernel's), B overwritten with b_later after the product is issued and before
    its wait; the accumulator read between them (acc_before_wait) and after (out)."""
    wgmma = make_wgmma(N, False)
    smem = cuda.shared.array(0, uint16)
    tid = cuda.threadIdx.x
    base = shared_base(smem, ALIGN)
    a_at, b_at = base, base + 64 * D * 2
    for e in range(tid, 64 * D, 128):
        smem[(a_at - base + swizzled_byte(e // D, e % D, 64)) // 2] = a[e // D, e % D]
    for e in range(tid, N * D, 128):
        smem[(b_at - base + swizzled_byte(e // D, e % D, N)) // 2] = b[e // D, e % D]
    cuda.syncthreads()
    acc = cuda.local.array(ACC_SHAPE, float32)
    for j in range(N // 8):
        for r in range(4):
            acc[j, r] = -1.0
    wgmma_fence()
    wgmma(acc, make_descriptor(a_at, 16, 1024), make_descriptor(b_at, 16, 1024), 0)
    wgmma_commit()
    store_accumulator(acc_before_wait, acc)
    cuda.syncthreads()
    for e in range(tid, N * D, 128):
        smem[(b_at - base + swizzled_byte(e // D, e % D, N)) // 2] = b_later[e // D, e % D]
    cuda.syncthreads()
    wgmma_wait(0)
    store_accumulator(out, acc)


STAGES, TILE_ROWS, TILE_COLS = 2, 16, 64  # the pipeline kernel's stages and tiles (16-bit)
BARRIERS = 2 * STAGES  # a full and an empty mbarrier per stage


def pipeline_kernel(src, out):
    """A producer warpgroup (registers given back) streams src's tiles (tiles, 16, 1, 64)
    through two shared stages with cp.async from global to shared addresses, full/empty
    mbarriers per stage; a consumer warpgroup (registers taken) copies each tile to out,
    meeting at a named barrier before it frees the stage. Every stage takes several tiles, so
    the barriers' phases wrap."""
    smem = cuda.shared.array(0, uint16)
    barriers = cuda.shared.array(BARRIERS, uint64)
    tid = cuda.threadIdx.x
    tiles = src.shape[0]
    base = shared_base(smem, 128)
    origin = shared_base(smem, 1)
    full, empty = shared_base(barriers, 8), shared_base(barriers, 8) + 8 * STAGES
    if tid == 0:
        for s in range(STAGES):
            mbarrier_init(full + 8 * s, 128)  # every producer thread arrives
            mbarrier_init(empty + 8 * s, 128)  # every consumer thread arrives
        fence_mbarrier_init()
    cuda.syncthreads()  # why: the barriers exist before anyone arrives or waits
    if tid < 128:
        setmaxnreg_dec(40)
        row, col = tid // 8, 8 * (tid % 8)  # 16 rows x 8 chunks of 16 bytes: one per thread
        for i in range(tiles):
            s = i % STAGES
            mbarrier_wait(empty + 8 * s, ((i // STAGES) + 1) % 2)  # (fresh: passes at once)
            cp_async_16_from(base + s * TILE_ROWS * TILE_COLS * 2 + row * 128 + col * 2,
                             global_address(src, i, row, 0, col), 16)
            cp_async_commit()
            cp_async_wait(0)
            fence_proxy_async()
            mbarrier_arrive(full + 8 * s)
    else:
        setmaxnreg_inc(232)
        c = tid - 128
        row, col = c // 8, 8 * (c % 8)
        for i in range(tiles):
            s = i % STAGES
            mbarrier_wait(full + 8 * s, (i // STAGES) % 2)
            at = (base - origin + s * TILE_ROWS * TILE_COLS * 2 + row * 128 + col * 2) // 2
            for e in range(8):
                out[i, row, 0, col + e] = smem[at + e]
            named_barrier_sync(1, 128)  # why: the consumers meet before the stage is freed
            mbarrier_arrive(empty + 8 * s)


def turns_kernel(log, count):
    """The block's warpgroups taking turns (hopper/turns.py) log.shape[0] // warpgroups times
    each: at each turn the warpgroup's first thread writes its number at the next place of
    the log."""
    tid = cuda.threadIdx.x
    consumer = tid // 128
    consumers = cuda.blockDim.x // 128
    turns = log.shape[0] // consumers
    open_turns(consumer, consumers)
    for turn in range(turns):
        take_turn(consumer)
        if tid % 128 == 0:
            log[count[0]] = consumer
            count[0] += 1
        give_turn(consumer, consumers, turn == turns - 1)


# (kernel, PTX signature, instructions its PTX must contain), compiled for sm_90a
PTX_CASES = [
    (make_scores_kernel(False), "(uint16[:, :], uint16[:, :], float32[:, :])",
     ["wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16", "wgmma.fence.sync.aligned",
      "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned 0",
      "fence.proxy.async.shared::cta"]),
    (make_pv_kernel(True), "(uint32[:, :, :], uint16[:, :], float32[:, :])",
     ["wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"]),
    (pipeline_kernel, "(uint16[:, :, :, :], uint16[:, :, :, :])",
     ["mbarrier.init.shared::cta.b64", "mbarrier.try_wait.parity.shared::cta.b64",
      "mbarrier.arrive.shared::cta.b64", "cp.async.cg.shared.global",
      "setmaxnreg.dec.sync.aligned.u32 40", "setmaxnreg.inc.sync.aligned.u32 232",
      "bar.sync 1, 128"]),
    (turns_kernel, "(int32[:], int32[:])",
     ["bar.sync 1, 256", "bar.sync 2, 256", "bar.sync 3, 256", "bar.arrive 1, 256",
      "bar.arrive 2, 256", "bar.arrive 3, 256"]),
]
