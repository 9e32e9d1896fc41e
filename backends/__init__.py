"""Backends of numba_flash, one module each; installed as `numba_flash.backends`.

The table maps a backend name to the module that defines it. Modules are imported only when a
backend is first asked for (numba_flash.registry), so that listing backends costs nothing.
"""

#: name -> (module inside numba_flash.backends, class name), in "auto" preference order
BACKEND_MODULES = {
    "numba": ("numba_backend", "NumbaBackend"),
    "numba-mma": ("numba_backend", "NumbaMmaBackend"),
    "numba-simt": ("numba_backend", "NumbaSimtBackend"),
    "cupy": ("cupy_standard", "CupyStandardBackend"),
    "numpy": ("numpy_reference", "NumpyReferenceBackend"),
}
