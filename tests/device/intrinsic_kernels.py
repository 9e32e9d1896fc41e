"""Small kernels exercising each intrinsic; used by test_intrinsics.py (simulator and GPU)
and compiled to PTX by its PTX test. Each launches with whole warps."""
from numba import cuda
from numba.core.types import float16, float32, uint16

from numba_flash.backends.numba.device.intrinsics import (
    SHARED_ALIGN, bits_of_float32, cp_async_16, cp_async_commit, cp_async_wait, exp2,
    float32_from_bits, ldmatrix_x4, ldmatrix_x4_at, ldmatrix_x4_trans, ldmatrix_x4_trans_at,
    mma_bf16, mma_f16, opaque, pack_bf16x2, pack_f16x2, reciprocal, shared_address,
    shared_tile, shfl_xor, unpack_bf16x2, unpack_f16x2)


def _make_mma_kernel(mma, name):
    def mma_kernel(a_frags, b_frags, c_frags, d_frags):
        """d = A B + C for one 16x8x16 product per warp; *_frags[warp, lane, :] are fragments."""
        tid = cuda.threadIdx.x
        w, lane = tid // 32, tid % 32
        d = mma(a_frags[w, lane, 0], a_frags[w, lane, 1], a_frags[w, lane, 2],
                a_frags[w, lane, 3], b_frags[w, lane, 0], b_frags[w, lane, 1],
                c_frags[w, lane, 0], c_frags[w, lane, 1], c_frags[w, lane, 2],
                c_frags[w, lane, 3])
        for i in range(4):
            d_frags[w, lane, i] = d[i]
    mma_kernel.__name__ = mma_kernel.__qualname__ = name
    return mma_kernel


mma_f16_kernel = _make_mma_kernel(mma_f16, "mma_f16_kernel")
mma_bf16_kernel = _make_mma_kernel(mma_bf16, "mma_bf16_kernel")


def ldmatrix_kernel(matrix, regs, regs_trans):
    """One warp: a 16x16 f16 tile in shared memory, read back with ldmatrix x4 (lane l points
    at row l % 16, column 8 * (l // 16)) with and without .trans."""
    tile = cuda.shared.array((16, 16), float16, SHARED_ALIGN)
    lane = cuda.threadIdx.x
    for c in range(16):
        tile[lane % 16, c] = matrix[lane % 16, c]
    cuda.syncthreads()
    r = ldmatrix_x4(tile, lane % 16, 8 * (lane // 16))
    rt = ldmatrix_x4_trans(tile, lane % 16, 8 * (lane // 16))
    for i in range(4):
        regs[lane, i] = r[i]
        regs_trans[lane, i] = rt[i]


def ldmatrix_at_kernel(matrix, regs, regs_trans):
    """One warp: a 32x24 f16 tile in shared memory; in a loop over it = 0, 1, the 16x16 block at
    rows 16·it, columns 8·it read with ldmatrix x4 (and .trans) at the lane's address plus a
    byte offset, the address passed through `opaque` each iteration as the kernels do."""
    tile = cuda.shared.array((32, 24), float16, SHARED_ALIGN)
    lane = cuda.threadIdx.x
    for c in range(24):
        tile[lane, c] = matrix[lane, c]
    cuda.syncthreads()
    base = shared_address(tile, lane % 16, 8 * (lane // 16))
    for it in range(2):
        at = opaque(base)
        r = ldmatrix_x4_at(at, 2 * (16 * it * 24 + 8 * it))
        rt = ldmatrix_x4_trans_at(at, 2 * (16 * it * 24 + 8 * it))
        for i in range(4):
            regs[it, lane, i] = r[i]
            regs_trans[it, lane, i] = rt[i]


def cp_async_kernel(src, dst, rows_valid):
    """One warp copies src[0, r, 0, 0:16] (f16) to shared rows with cp.async, 16 bytes per lane;
    rows >= rows_valid are zero-filled. Then the tile goes to dst."""
    tile = cuda.shared.array((16, 16), float16, SHARED_ALIGN)
    lane = cuda.threadIdx.x
    row, col = lane // 2, 8 * (lane % 2)
    cp_async_16(tile, row, col, src, 0, row, 0, col, 16 if row < rows_valid else 0)
    cp_async_commit()
    cp_async_wait(0)
    cuda.syncthreads()
    for c in range(8):
        dst[row, col + c] = tile[row, col + c]


def shfl_sum_kernel(values, sums):
    """Butterfly sum over each warp with shfl_xor; every lane ends with its warp's total."""
    tid = cuda.threadIdx.x
    total = values[tid]
    for mask in (16, 8, 4, 2, 1):
        total += shfl_xor(total, mask)
    sums[tid] = total


def pack_kernel(x, f16_words, bf16_words, f16_back, bf16_back):
    i = cuda.threadIdx.x
    f16_words[i] = pack_f16x2(x[i, 0], x[i, 1])
    bf16_words[i] = pack_bf16x2(x[i, 0], x[i, 1])
    lo, hi = unpack_f16x2(f16_words[i])
    f16_back[i, 0] = lo
    f16_back[i, 1] = hi
    lo, hi = unpack_bf16x2(bf16_words[i])
    bf16_back[i, 0] = lo
    bf16_back[i, 1] = hi


def bitcast_kernel(bits, y, bits_back):
    i = cuda.threadIdx.x
    y[i] = float32_from_bits(bits[i])
    bits_back[i] = bits_of_float32(y[i])


def exp2_kernel(x, y):
    i = cuda.threadIdx.x
    y[i] = exp2(x[i])


def reciprocal_kernel(x, y):
    i = cuda.threadIdx.x
    y[i] = reciprocal(x[i])


def shared_tile_kernel(halves, words, halves_out, words_out):
    """Two tiles carved from dynamic shared memory: a (4, 24) uint16 tile at byte 0 and a
    (2, 8) float32 tile at byte 192, filled and read back through their 2-D views."""
    smem = cuda.shared.array(0, uint16, SHARED_ALIGN)
    a = shared_tile(smem, 0, 4, 24, uint16)
    b = shared_tile(smem, 192, 2, 8, float32)
    i = cuda.threadIdx.x
    for c in range(24):
        a[i, c] = halves[i, c]
    if i < 2:
        for c in range(8):
            b[i, c] = words[i, c]
    cuda.syncthreads()
    for c in range(24):
        halves_out[i, c] = smem[24 * i + c]  # the tiles are where the offsets say
    if i < 2:
        for c in range(8):
            words_out[i, c] = b[i, c]


# (kernel, PTX signature, instructions its PTX must contain)
PTX_CASES = [
    (mma_f16_kernel, "(uint32[:, :, :], uint32[:, :, :], float32[:, :, :], float32[:, :, :])",
     ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"]),
    (mma_bf16_kernel, "(uint32[:, :, :], uint32[:, :, :], float32[:, :, :], float32[:, :, :])",
     ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"]),
    (ldmatrix_kernel, "(float16[:, :], uint32[:, :], uint32[:, :])",
     ["ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix.sync.aligned.m8n8.x4.trans"]),
    (ldmatrix_at_kernel, "(float16[:, :], uint32[:, :, :], uint32[:, :, :])",
     ["cvta.to.shared.u64", "mov.b32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "}, [%r"]),  # (a 32-bit address)
    (cp_async_kernel, "(float16[:, :, :, :], float16[:, :], int32)",
     ["cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group 0"]),
    (shfl_sum_kernel, "(float32[:], float32[:])", ["shfl.sync.bfly"]),
    (pack_kernel, "(float32[:, :], uint32[:], uint32[:], float32[:, :], float32[:, :])",
     ["cvt.rn.f16x2.f32", "cvt.rn.bf16x2.f32", "cvt.f32.f16"]),
    (exp2_kernel, "(float32[:], float32[:])", ["ex2.approx.ftz.f32"]),
    (shared_tile_kernel, "(uint16[:, :], float32[:, :], uint16[:, :], float32[:, :])",
     ["st.shared.f32", "ld.shared.u16"]),
]
