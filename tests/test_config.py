"""Tile configurations: every entry fits its shared-memory limit and divides evenly."""
import pytest

from numba_flash.config import (SHARED_MEMORY_BYTES, SimtForwardConfig, backward_shared_bytes,
                                simt_backward_config, simt_forward_candidates,
                                simt_forward_config, simt_forward_shared_bytes)

HEAD_DIMS = [1, 16, 32, 33, 64, 65, 96, 128, 129, 200, 256]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_backward_configs_fit_and_divide(head_dim):
    config = simt_backward_config(head_dim)
    assert backward_shared_bytes(config, head_dim) <= SHARED_MEMORY_BYTES
    padded = config.padded_head_dim(head_dim)
    assert padded >= head_dim and padded % (4 * config.threads_x) == 0
    assert config.block_m % config.threads_y == 0 and config.block_n % config.threads_y == 0
    assert config.block_m % config.threads_x == 0 and config.block_n % config.threads_x == 0
    assert config.block_m % 4 == 0 and config.block_n % 4 == 0  # 16-byte reads of P


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_forward_candidates_end_with_one_that_fits_48_kib(head_dim):
    candidates = simt_forward_candidates(head_dim)
    assert simt_forward_shared_bytes(candidates[-1], head_dim) <= SHARED_MEMORY_BYTES
    for config in candidates:
        assert config.padded_head_dim(head_dim) >= head_dim
        assert config.padded_head_dim(head_dim) % 32 == 0  # 8 column groups of 4-wide chunks
        assert config.block_n % 4 == 0  # 16-byte reads of P rows


def test_forward_config_is_the_first_candidate_that_fits():
    first, fallback = simt_forward_candidates(64)[0], simt_forward_candidates(64)[-1]
    assert simt_forward_config(64, 227 * 1024) == first
    assert simt_forward_config(64, SHARED_MEMORY_BYTES) == fallback
    assert simt_forward_config(64) == fallback  # the limit every CUDA GPU gives
    assert simt_forward_shared_bytes(SimtForwardConfig(4, 8, 4), 64) == 4 * (
        (128 + 2 * 32) * 68 + 128 * 40)
    with pytest.raises(ValueError, match="no SIMT forward config for headdim 64 fits 1024 "
                                         "bytes"):
        simt_forward_config(64, 1024)


def test_head_dim_above_256_is_refused():
    with pytest.raises(ValueError, match="headdim must be <= 256; got 257"):
        simt_forward_config(257)
    with pytest.raises(ValueError, match="headdim must be <= 256; got 257"):
        simt_backward_config(257)


@pytest.mark.parametrize("shape, message", [((64, 30, 8, 16), "30 is not a multiple of 8"),
                                            ((24, 24, 8, 16), "24 is not a multiple of 16"),
                                            ((12, 12, 6, 6), "multiple")])
def test_invalid_configs_are_refused(shape, message):
    from numba_flash.config import SimtConfig
    with pytest.raises(ValueError, match=message):
        SimtConfig(*shape)
