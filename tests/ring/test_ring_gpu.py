"""ring_attention on one GPU (`-m gpu`): a world of one over NCCL at a real size against float64
attention of the sequence by the accuracy rule, and the overlap the ring relies on: our
attention kernels on torch's current stream run beside a copy on another stream (NCCL's
messages travel on a stream of their own)."""
import os
import socket

import numpy as np
import pytest
from error_rule import assert_within_rule

from numba_flash.reference import attention_backward, attention_forward
from numba_flash.spec import make_spec
from numba_flash.testing import plain16_backward, plain16_forward, round16

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def nccl_world_of_one():
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_world_of_one_is_attention_over_the_whole_sequence(nccl_world_of_one, layout):
    import cupy as cp

    import numba_flash.torch as nft
    rng = np.random.default_rng()
    shape = (1, 2048, 8, 128)
    values = [round16(cp, cp.asarray(rng.standard_normal(shape), cp.float32), "bfloat16")
              for _ in range(4)]
    values[1], values[2] = values[1][:, :, :2].copy(), values[2][:, :, :2].copy()  # GQA 4
    q, k, v, dout = values
    q_t, k_t, v_t = (torch.from_dlpack(x).to(torch.bfloat16).requires_grad_(True)
                     for x in (q, k, v))
    shards = [nft.shard_sequence(x, layout=layout) for x in (q_t, k_t, v_t)]
    out = nft.ring_attention(*shards, causal=True, layout=layout)
    dout_t = torch.from_dlpack(dout).to(torch.bfloat16)
    (out.float() * nft.shard_sequence(dout_t, layout=layout).float()).sum().backward()

    spec = make_spec(q, k, causal=True)
    ref_out, ref_lse = attention_forward(cp, q, k, v, spec, "float64")
    base_out, base_lse = plain16_forward(cp, q, k, v, spec, "bfloat16")
    got = nft.unshard_sequence(out, layout=layout).float()
    assert_within_rule("out", cp.asarray(got).get(), base_out.get(), ref_out.get(), "bfloat16")
    refs = attention_backward(cp, dout, q, k, v, ref_out, ref_lse, spec, "float64")
    bases = plain16_backward(cp, dout, q, k, v, base_out, base_lse, spec, "bfloat16")
    for name, x, base, ref in zip(("dq", "dk", "dv"), (q_t, k_t, v_t), bases, refs):
        assert_within_rule(name, x.grad.float().cpu().numpy(), base.get(), ref.get(),
                           "bfloat16")


#: blocks of the stand-in for a ring step's transfer: NCCL's point-to-point kernels run on a
#: few blocks, so that the attention has the rest of the multiprocessors
COPY_BLOCKS = 8


def test_attention_overlaps_a_copy_on_another_stream():
    """The ring's schedule: a step's kernels on the current stream while the next shard's
    message moves on another. A copy of about the attention's duration, on a second stream
    and on COPY_BLOCKS blocks as NCCL's kernels, and the attention together take clearly
    less than one after the other. (A copy over the whole GPU would not overlap: the
    attention's blocks fill every multiprocessor, and the copy's wait for them.)"""
    from numba import cuda

    import numba_flash.torch as nft
    q, k, v = (torch.randn(1, 8192, 16, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    side = torch.cuda.Stream()

    @cuda.jit
    def few_block_copy(source, target):
        for i in range(cuda.grid(1), source.size, cuda.gridsize(1)):
            target[i] = source[i]

    def attention():
        return nft.attention(q, k, v, causal=True)

    def timed(fn):
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop)

    def copy_on_the_side(source, target):
        few_block_copy[COPY_BLOCKS, 512, cuda.external_stream(side.cuda_stream)](source,
                                                                                 target)

    def copy():
        side.wait_stream(torch.cuda.current_stream())
        copy_on_the_side(source, target)
        torch.cuda.current_stream().wait_stream(side)

    attention()
    attention_ms = min(timed(attention) for _ in range(5))
    # the copy sized to about the attention's time
    source = torch.ones(1 << 22, device="cuda", dtype=torch.float32)
    target = torch.empty_like(source)
    copy()
    words = int(source.numel() * attention_ms / min(timed(copy) for _ in range(3)))
    source = torch.ones(words, device="cuda", dtype=torch.float32)
    target = torch.empty_like(source)
    copy()
    copy_ms = min(timed(copy) for _ in range(5))

    def both():
        side.wait_stream(torch.cuda.current_stream())
        copy_on_the_side(source, target)
        attention()
        torch.cuda.current_stream().wait_stream(side)

    both()
    both_ms = min(timed(both) for _ in range(5))
    assert both_ms < 0.85 * (attention_ms + copy_ms), (attention_ms, copy_ms, both_ms)
    assert bool((target == 1).all())
