"""Tile configurations: every entry fits the static shared-memory limit and divides evenly."""
import pytest

from numba_flash.config import (SHARED_MEMORY_BYTES, backward_shared_bytes, forward_shared_bytes,
                                simt_backward_config, simt_forward_config)


@pytest.mark.parametrize("head_dim", [1, 16, 32, 33, 64, 65, 96, 128, 129, 200, 256])
def test_configs_fit_and_divide(head_dim):
    for config, shared in ((simt_forward_config(head_dim), forward_shared_bytes),
                           (simt_backward_config(head_dim), backward_shared_bytes)):
        assert shared(config, head_dim) <= SHARED_MEMORY_BYTES
        padded = config.padded_head_dim(head_dim)
        assert padded >= head_dim and padded % (4 * config.threads_x) == 0
        assert config.block_m % config.threads_y == 0 and config.block_n % config.threads_y == 0
        assert config.block_m % config.threads_x == 0 and config.block_n % config.threads_x == 0
        assert config.block_m % 4 == 0 and config.block_n % 4 == 0  # 16-byte reads of P


def test_head_dim_above_256_is_refused():
    with pytest.raises(ValueError, match="headdim must be <= 256; got 257"):
        simt_forward_config(257)


@pytest.mark.parametrize("shape, message", [((64, 30, 8, 16), "30 is not a multiple of 8"),
                                            ((24, 24, 8, 16), "24 is not a multiple of 16"),
                                            ((12, 12, 6, 6), "multiple")])
def test_invalid_configs_are_refused(shape, message):
    from numba_flash.config import SimtConfig
    with pytest.raises(ValueError, match=message):
        SimtConfig(*shape)
