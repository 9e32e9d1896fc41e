"""copy_padded: copy a (batch, seqlen, nheads, width) array into one of another head width,
zero-filling the columns the source lacks. The numba backends use it to hand their cp.async
loads contiguous, 16-byte aligned copies of inputs they cannot read in place (strided views;
for the tensor-core kernels also head dims that are not a multiple of 16), and to copy the
tensor-core kernels' padded results back into the caller's arrays.
"""
from numba import cuda

from .numba_backend import simulator_enabled
from .numba_launch import launch

THREADS = 256
MAX_BLOCKS = 4096  # grid-stride beyond this: enough blocks to fill any current GPU


@cuda.jit(cache=True)
def _copy_padded_kernel(src, dst):
    batch, seqlen, nheads, width = dst.shape
    src_width = src.shape[3]
    for i in range(cuda.grid(1), batch * seqlen * nheads * width, cuda.gridsize(1)):
        d = i % width
        row = i // width
        h = row % nheads
        n = (row // nheads) % seqlen
        b = row // (nheads * seqlen)
        dst[b, n, h, d] = src[b, n, h, d] if d < src_width else 0


def copy_padded(src, dst, stream=0):
    """dst[..., :w] = src[..., :w] with w = min(widths), and dst[..., w:] = 0, on `stream`."""
    if simulator_enabled():  # NumPy views: a per-element simulated kernel would only be slower
        width = min(src.shape[3], dst.shape[3])
        dst[..., :width] = src[..., :width]
        dst[..., width:] = 0
        return
    total = dst.size
    if total:
        blocks = min(-(-total // THREADS), MAX_BLOCKS)
        launch(_copy_padded_kernel, blocks, THREADS, stream, 0, src, dst)
