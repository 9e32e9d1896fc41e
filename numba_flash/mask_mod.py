"""A mask_mod as the kernels take it: its code, with the arrays it captures as arguments.

A mask_mod often reads arrays it captures (document ids, prefix lengths), and they change
from batch to batch, while compiling the kernels for a mask_mod takes tens of seconds. So, as
FlexAttention does with captured tensors, a captured array is an input of the kernels, not
a constant of them: `lower(mask_mod)` gives a MaskModProgram, the same function with every
captured array (a closure variable or a global it reads) made a trailing parameter, and the
arrays of this call. The program is made once per code and per value of the other captured
names (numbers, strings, functions: compiled in as constants), so a new closure over new
arrays of the same code, or a global rebound to a new array, compiles nothing and reads the
new values; a changed constant makes a new program.

The program is built from mask_mod's source (inspect.getsource), which a function that
captures arrays must have; a function it calls must not capture arrays itself.
"""
import ast
import inspect
import textwrap
import threading
from typing import NamedTuple

import numpy as np

from . import _arrays


class MaskModProgram(NamedTuple):
    """function(b, h, q_idx, kv_idx, *captured arrays) -> bool; `captured`: the arrays'
    names, in parameter order; `name`: mask_mod's, for messages. Hashed by the function's
    identity (the kernels' cache key: one program per code and constants)."""
    function: object
    captured: tuple
    name: str


#: program per (code, constants, captured names); past this many the oldest goes
MAX_PROGRAMS = 256
_programs = {}
_lock = threading.Lock()


def lower(mask_mod):
    """(MaskModProgram, the captured arrays in its parameter order) of a checked mask_mod
    (spec.check_mask_mod), or (None, ()) for None."""
    if mask_mod is None:
        return None, ()
    names, arrays, constants = [], [], []
    for name, value in _captured(mask_mod):
        if _is_array(value):
            names.append(name)
            arrays.append(value)
        else:
            constants.append((name, _constant_key(mask_mod, name, value)))
    key = (mask_mod.__code__, tuple(constants), tuple(names))
    program = _programs.get(key)
    if program is None:
        program = MaskModProgram(_with_parameters(mask_mod, names) if names else mask_mod,
                                 tuple(names), _name(mask_mod))
        with _lock:
            if len(_programs) >= MAX_PROGRAMS:
                del _programs[next(iter(_programs))]
            program = _programs.setdefault(key, program)
    return program, tuple(arrays)


def _is_array(value):
    """An array a kernel can read (NumPy, CuPy, torch, __cuda_array_interface__), not some
    other object of those libraries (a dtype, a module)."""
    return (hasattr(value, "shape") and hasattr(value, "dtype")
            and _arrays.array_kind(value) is not None)


def _name(mask_mod):
    return getattr(mask_mod, "__name__", "mask_mod")


def _captured(mask_mod):
    """(name, value) of each closure variable and each global mask_mod's code names (a name
    it also uses as an attribute comes along: harmless)."""
    code = mask_mod.__code__
    cells = mask_mod.__closure__ or ()
    for name, cell in zip(code.co_freevars, cells):
        try:
            yield name, cell.cell_contents
        except ValueError:  # (a closure variable not assigned yet)
            raise TypeError(f"mask_mod {_name(mask_mod)!r} reads {name!r}, which is not "
                            f"assigned yet") from None
    namespace = mask_mod.__globals__
    for name in code.co_names:
        if name in namespace:
            yield name, namespace[name]


class _Same:
    """A key part equal only to itself's object (for values compared by identity)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self):
        return id(self.value)


_BY_VALUE = (bool, int, float, complex, str, bytes, type(None), np.generic)


def _constant_key(mask_mod, name, value):
    """What of a captured non-array value the program depends on: numbers and strings (and
    tuples of them) by value, anything else (functions, modules) by identity."""
    if isinstance(value, _BY_VALUE):
        return type(value), value
    if isinstance(value, (tuple, list)):
        if any(_is_array(x) for x in value):
            raise TypeError(f"mask_mod {_name(mask_mod)!r} captures arrays inside {name!r}: "
                            f"capture each array by its own name")
        if all(isinstance(x, _BY_VALUE) for x in value):
            return type(value), tuple(value)
    if inspect.isfunction(value):
        inner = [n for n, x in _captured(value) if _is_array(x)]
        if inner:
            raise TypeError(f"mask_mod {_name(mask_mod)!r} calls {name!r}, which captures the "
                            f"array {inner[0]!r}: capture arrays in mask_mod itself")
    return _Same(value)


def _with_parameters(mask_mod, names):
    """mask_mod's code recompiled with `names` as trailing parameters (its other captured
    names as globals of the new function)."""
    node = _definition(mask_mod)
    module = ast.parse("def _mask_mod_program():\n    pass\n")
    function = module.body[0]
    function.args = node.args
    function.args.args = node.args.args + [ast.arg(arg=name) for name in names]
    function.body = ([ast.Return(node.body)] if isinstance(node, ast.Lambda) else node.body)
    ast.copy_location(function, node)
    module = ast.fix_missing_locations(module)
    namespace = {"__builtins__": mask_mod.__globals__.get("__builtins__", __builtins__)}
    namespace.update((name, value) for name, value in _captured(mask_mod)
                     if name not in names)
    exec(compile(module, mask_mod.__code__.co_filename, "exec"), namespace)
    program = namespace["_mask_mod_program"]
    program.__name__ = program.__qualname__ = _name(mask_mod)
    return program


def _definition(mask_mod):
    """The def or lambda node of mask_mod in its source (line numbers as in its file)."""
    name = _name(mask_mod)
    try:
        lines, first = inspect.getsourcelines(mask_mod)
    except (OSError, TypeError):
        raise TypeError(f"mask_mod {name!r} captures arrays, so its source is needed (to make "
                        f"them arguments of the kernels) and Python has none for it; define "
                        f"it in a file or a notebook cell") from None
    source = textwrap.dedent("".join(lines))
    candidates = []
    for text in (source, f"({source.strip().rstrip(',')})"):  # (a lambda inside a call)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        candidates = [node for node in ast.walk(tree)
                      if isinstance(node, (ast.FunctionDef, ast.Lambda))
                      and (isinstance(node, ast.Lambda) or node.name == name)
                      and len(node.args.args) == mask_mod.__code__.co_argcount]
        if candidates:
            break
    if len(candidates) != 1:
        raise TypeError(f"mask_mod {name!r} captures arrays, so its source is needed, and "
                        f"its definition could not be told apart in it; define it with def")
    node = candidates[0]
    ast.increment_lineno(node, max(first, 1) - 1)
    return node
