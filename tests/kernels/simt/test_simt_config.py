"""Tile configurations: every entry fits its shared-memory limit and divides evenly."""
import pytest

from numba_flash.backends.numba.gpu import SHARED_MEMORY_BYTES
from numba_flash.backends.numba.simt.config import (SimtBackwardConfig, SimtForwardConfig,
                                                    simt_backward_candidates, simt_backward_config,
                                                    simt_backward_shared_bytes,
                                                    simt_forward_candidates,
                                                    simt_forward_config, simt_forward_shared_bytes)

HEAD_DIMS = [1, 16, 32, 33, 64, 65, 96, 128, 129, 200, 256]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_backward_candidates_end_with_one_that_fits_48_kib(head_dim):
    candidates = simt_backward_candidates(head_dim)
    assert max(simt_backward_shared_bytes(candidates[-1], head_dim)) <= SHARED_MEMORY_BYTES
    for config in candidates:
        assert config.stages in (1, 2)
        assert config.dk_dv_tiles[1] <= config.threads  # a thread per lse and D value


def test_backward_config_is_the_first_candidate_that_fits():
    first, fallback = simt_backward_candidates(64)[0], simt_backward_candidates(64)[-1]
    assert simt_backward_config(64, 227 * 1024) == first
    assert simt_backward_config(64) == fallback
    # dk/dv: K, V of 64 keys, two stages of Q, dO of 32 queries, P and dS, two stages of
    # lse and D; dq: Q, dO of 64 queries, two stages of K, V of 32 keys, dS.
    config = SimtBackwardConfig(4, 4, 4, 4, 4)
    assert simt_backward_shared_bytes(config, 64) == (
        4 * ((2 * 64 + 2 * 2 * 32) * 68 + 2 * 64 * 40 + 2 * 2 * 32),
        4 * ((2 * 64 + 2 * 2 * 32) * 68 + 64 * 40))
    with pytest.raises(ValueError, match="no SIMT backward config for headdim 64 fits 1024"):
        simt_backward_config(64, 1024)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_forward_candidates_end_with_one_that_fits_48_kib(head_dim):
    candidates = simt_forward_candidates(head_dim)
    assert simt_forward_shared_bytes(candidates[-1], head_dim) <= SHARED_MEMORY_BYTES


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


@pytest.mark.parametrize("make, message", [
    (lambda: SimtForwardConfig(0, 8, 4), "every field must be >= 1"),
    (lambda: SimtBackwardConfig(4, 4, 4, 0, 4), "every tile field must be >= 1"),
    (lambda: SimtBackwardConfig(4, 4, 4, 4, 4, stages=3), "stages must be 1 or 2")])
def test_invalid_configs_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()
