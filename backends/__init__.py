"""Backends of numba_flash; installed as `numba_flash.backends`.

The table maps a backend name to the module that defines it: base.py is the contract,
numpy_reference.py and cupy_standard.py are standard attention, numba/ holds the Numba kernels
(a package per kernel family). Modules are imported only when a backend is first asked for
(numba_flash.registry), so that listing backends costs nothing.
"""

#: name -> (module inside numba_flash.backends, class name), in "auto" preference order
BACKEND_MODULES = {
    "numba": ("numba.backend", "NumbaBackend"),
    "numba-hopper": ("numba.backend", "NumbaHopperBackend"),
    "numba-mma": ("numba.backend", "NumbaMmaBackend"),
    "numba-simt": ("numba.backend", "NumbaSimtBackend"),
    "cupy": ("cupy_standard", "CupyStandardBackend"),
    "numpy": ("numpy_reference", "NumpyReferenceBackend"),
}
