"""The backend table: name -> backend object, imported lazily; the default backend; "auto".

`auto` tries the registered backends in order (numba, cupy, numpy) and takes the first whose
`supports(spec, q, k, v)` says yes; `select_backend` tells which one it took and why it skipped
the others.
The default backend is "auto", or NUMBA_FLASH_BACKEND, or whatever `use_backend` set.
"""
import contextlib
import contextvars
import importlib
import os
from collections import namedtuple

from numba_flash import _checks
from numba_flash.spec import make_spec
from numba_flash.backends import BACKEND_MODULES

AUTO = "auto"
ENV_VAR = "NUMBA_FLASH_BACKEND"

_instances = {}
_default = contextvars.ContextVar("numba_flash_default_backend", default=None)


def list_backends():
    """Names of all registered backends, in the order "auto" tries them."""
    return list(BACKEND_MODULES)


def _check_name(name, where="backend"):
    if name != AUTO and name not in BACKEND_MODULES:
        raise ValueError(f"unknown {where} {name!r}; registered backends: "
                         f"{', '.join(BACKEND_MODULES)} (or {AUTO!r})")


def get_backend(name):
    """The backend object registered as `name` (its module is imported on first use)."""
    if name not in BACKEND_MODULES:
        _check_name(name)
        raise ValueError(f"{AUTO!r} is not a backend object; pass a registered name: "
                         f"{', '.join(BACKEND_MODULES)}")
    if name not in _instances:
        module_name, class_name = BACKEND_MODULES[name]
        module = importlib.import_module(f"numba_flash.backends.{module_name}")
        _instances[name] = getattr(module, class_name)()
    return _instances[name]


def available_backends():
    """{name: None if usable on this machine, else the reason it is not}."""
    result = {}
    for name in BACKEND_MODULES:
        backend = get_backend(name)
        result[name] = backend.available() if hasattr(backend, "available") else None
    return result


def default_backend():
    """The backend name used when a call says backend="auto" (or nothing)."""
    name = _default.get()
    if name is None:
        name = os.environ.get(ENV_VAR, AUTO) or AUTO
        _check_name(name, where=f"backend in ${ENV_VAR}")
    return name


@contextlib.contextmanager
def use_backend(name):
    """Within the block, backend="auto" calls use `name` (restored on exit, even on error)."""
    _check_name(name)
    token = _default.set(name)
    try:
        yield get_backend(name) if name != AUTO else None
    finally:
        _default.reset(token)


class Selection(namedtuple("Selection", "name skipped")):
    """The backend a call would use, and {skipped backend: reason}."""

    def __str__(self):
        lines = [f"using backend {self.name!r}" if self.name else "no backend can run this call"]
        lines += [f"  {name}: not used because {reason}" for name, reason in self.skipped.items()]
        return "\n".join(lines)


def select_backend(q, k, v, *, backend=AUTO, alibi_slopes=None, attn_mask=None, mask_mod=None,
                   block_mask=None, **options):
    """Which backend runs this call (forward's options: causal, softmax_scale, window_size,
    softcap, alibi_slopes, attn_mask, mask_mod, block_mask), and why each backend tried before
    it was skipped."""
    spec = make_spec(q, k, alibi=alibi_slopes is not None, attn_mask=_checks.mask_dtype(attn_mask),
                     mask_mod=_checks.lowered_mask_mod(mask_mod, block_mask)[0], **options)
    return _select(backend, spec, q, k, v)


def _select(backend, spec, q, k, v, kvcache=False):
    _check_name(backend)
    name = default_backend() if backend == AUTO else backend
    candidates = list(BACKEND_MODULES) if name == AUTO else [name]
    skipped = {}
    for candidate in candidates:
        impl = get_backend(candidate)
        reason = (impl.supports_kvcache(spec, q, k) if kvcache
                  else impl.supports(spec, q, k, v))
        if reason is None:
            return Selection(candidate, skipped)
        skipped[candidate] = reason
    return Selection(None, skipped)


def resolve(backend, spec, q, k, v, kvcache=False):
    """The backend object that will run this call (kvcache: a forward_kvcache call, k and v
    its caches); ValueError naming the reasons if none can."""
    selection = _select(backend, spec, q, k, v, kvcache)
    if selection.name is not None:
        return get_backend(selection.name)
    if len(selection.skipped) == 1:
        (name, reason), = selection.skipped.items()
        message = f"backend {name!r} cannot run this call: {reason}"
    else:
        reasons = "; ".join(f"{n}: {r}" for n, r in selection.skipped.items())
        message = f"no backend can run this call ({reasons})"
    dtype = spec.dtype
    serving = [n for n in BACKEND_MODULES if dtype in get_backend(n).dtypes]
    if any(dtype not in get_backend(n).dtypes for n in selection.skipped) and serving:
        message += f"; backends that support {dtype}: {', '.join(serving)}"
    raise ValueError(message)
