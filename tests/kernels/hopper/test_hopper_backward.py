"""The Hopper backward kernels (backends/numba/hopper/bwd_dk_dv.py, bwd_dq.py) against the
float64 reference: under the simulator at small sizes (a few cases: three warpgroups of
Python threads each, every variant the engine takes among them), and with `-m gpu` on an
sm_90 GPU at real sizes."""
import pytest
from mma_cases import run_backward
from mask_mods import gapped_mask

from numba_flash.backends.numba.hopper.bwd import launch_hopper_backward
from numba_flash.backends.numba.hopper.config import HopperBackwardConfig

# (batch, seqlen_q, seqlen_k, nheads, head_dim), kv_heads, causal, dtype, config, options
# (each case simulates three warpgroups of Python threads through two kernels: a few cases,
# the variants' rules being the shared device modules', which tests/variants and the GPU
# variant suite run through these kernels; the producers copy with the copy engine but in
# the varlen case, config.copies_for, and the one marked cp.async)
SIMULATOR_CASES = [
    ((1, 40, 90, 2, 64), 1, True, "bfloat16", HopperBackwardConfig(32, 32),
     dict(window_left=20, softcap=2.0, alibi=True)),  # GQA, a window, softcap, ALiBi
    ((1, 50, 60, 1, 128), None, True, "float16", HopperBackwardConfig(32, 64), {}),
    ((1, 50, 60, 1, 128), None, False, "float16",
     HopperBackwardConfig(32, 64, copy_engine=False), {}),  # cp.async
    ((4, 40, 50, 1, 64), None, True, "bfloat16", HopperBackwardConfig(32, 32),
     dict(lengths=[(33, 40), (0, 7), (40, 50), (9, 0)], alibi=True)),  # varlen, empty
    #   sequences; with ALiBi, the dQ kernel's consumers do not take turns
]

# masks: a mask_mod whose tile tables leave an empty tile inside the ranges of both kernels
# (the other masks' code is the forward's, tests/kernels/hopper/test_hopper_forward.py, and
# the tensor-core backward's; all of them run through these kernels in the GPU variant suite)
MASK_CASES = [  # (16-query tiles for dK/dV, as the masked d128 config's; GQA: each query
    #              head of the group its own empty key tile)
    ((1, 70, 100, 2, 64), 1, False, "float16", HopperBackwardConfig(16, 32),
     dict(mask_mod=gapped_mask, softcap=2.0)),
]

GPU_SHAPES = [(2, 1000, 1000, 4, 64), (1, 2048, 2048, 8, 128), (1, 777, 1500, 4, 128),
              (1, 1500, 700, 4, 128)]


@pytest.mark.parametrize("shape, kv_heads, causal, dtype, config, options", SIMULATOR_CASES,
                         ids=[f"sim-{'x'.join(map(str, c[0]))}-{c[2]}-{c[3]}-{len(c[5])}"
                              for c in SIMULATOR_CASES])
def test_hopper_backward_in_the_simulator(rng, shape, kv_heads, causal, dtype, config,
                                          options):
    run_backward(rng, shape, causal, dtype, config, kv_heads, launch=launch_hopper_backward,
                 **options)


@pytest.mark.parametrize("shape, kv_heads, causal, dtype, config, options", MASK_CASES,
                         ids=[f"sim-{'x'.join(map(str, c[0]))}-{c[2]}-{c[3]}-"
                              f"{'-'.join(getattr(x, '__name__', str(x)) for x in c[5].values())}"
                              for c in MASK_CASES])
def test_hopper_backward_with_masks_in_the_simulator(rng, shape, kv_heads, causal, dtype,
                                                     config, options):
    run_backward(rng, shape, causal, dtype, config, kv_heads, launch=launch_hopper_backward,
                 **options)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["x".join(map(str, s)) for s in GPU_SHAPES])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_backward_on_the_gpu(rng, shape, causal, dtype):
    from numba import cuda
    if tuple(cuda.get_current_device().compute_capability) != (9, 0):
        pytest.skip("the Hopper kernels need compute capability 9.0")
    run_backward(rng, shape, causal, dtype, None, launch=launch_hopper_backward)


def test_head_dims_without_a_backward_config_are_refused():
    import numpy as np

    from numba_flash.spec import AttentionSpec
    q = np.zeros((1, 16, 1, 256), np.uint16)
    lse = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match="no Hopper backward config for head_dim 256"):
        launch_hopper_backward(AttentionSpec(256, "float16", softmax_scale=0.1), q, q, q, q, q,
                               lse, lse, q, q, q)


def test_the_backward_refuses_fewer_than_three_stages():
    with pytest.raises(ValueError, match="needs 3 stages or more"):
        HopperBackwardConfig(32, 64, stages=2)


def test_the_backward_takes_the_copy_engine(rng, monkeypatch):
    """A plain backward through "numba-hopper" encodes the maps of both kernels (q, dout, k,
    v each, with their boxes), and its producers keep registers the block holds."""
    import numpy as np

    import numba_flash
    from numba_flash.backends.numba.hopper import bwd, tensor_maps
    chosen = []

    def spy(arrays_and_rows):
        chosen.append(tensor_maps.map_templates(arrays_and_rows))
        return chosen[-1]
    monkeypatch.setattr(bwd, "map_templates", spy)
    q, k, v, dout = (rng.standard_normal((1, 30, 1, 64)).astype(np.float16) for _ in range(4))
    out, lse = numba_flash.forward(q, k, v, backend="numba-hopper")
    numba_flash.backward(dout, q, k, v, out, lse, backend="numba-hopper")
    assert len(chosen) == 1 and chosen[0] is not None and len(chosen[0]) == 8
    for config in (HopperBackwardConfig(64, 64), HopperBackwardConfig(64, 64, copy_engine=False),
                   HopperBackwardConfig(16, 32, wide_producer=True)):
        producer, consumer = config.registers
        assert 128 * (producer + 2 * consumer) <= 168 * 384
    assert HopperBackwardConfig(64, 64).registers[1] > HopperBackwardConfig(
        64, 64, wide_producer=True).registers[1]
