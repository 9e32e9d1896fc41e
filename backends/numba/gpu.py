"""What the Numba backends ask of the machine: the simulator or a GPU, and the GPU's limits."""
import functools

#: dynamic shared memory every CUDA GPU gives a block without opting in
SHARED_MEMORY_BYTES = 48 * 1024
#: compute capability of the first GPUs with bf16 mma.sync, ldmatrix and cp.async
TENSOR_CORE_CC = (8, 0)


@functools.lru_cache(maxsize=None)
def simulator_enabled():
    """Whether numba.cuda is the simulator (decided when numba.cuda is imported, so imported
    first; asked per launch)."""
    from numba import config, cuda  # noqa: F401
    return bool(config.ENABLE_CUDASIM)


@functools.lru_cache(maxsize=None)
def compute_capability(device_id):
    from numba import cuda
    with cuda.gpus[device_id]:
        return tuple(cuda.get_current_device().compute_capability)


@functools.lru_cache(maxsize=None)
def shared_memory_limit(device_id):
    """The most shared memory a block may take on this GPU (opting in above 48 KiB)."""
    from numba import cuda
    with cuda.gpus[device_id]:
        return int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


@functools.lru_cache(maxsize=None)
def multiprocessors(device_id):
    """The GPU's multiprocessors (how many blocks of one block each run at once)."""
    from numba import cuda
    with cuda.gpus[device_id]:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
