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
captures arrays must have; an array it would reach other than by its own name (in a
container, a module, a function it calls) is refused, since it would be compiled in.
"""
import ast
import dis
import inspect
import textwrap
import threading
import numpy as np

from . import _arrays


class MaskModProgram:
    """function(b, h, q_idx, kv_idx, *captured arrays) -> bool; `captured`: the arrays'
    names, in parameter order; `name`: mask_mod's, for messages; reads_batch, reads_head:
    whether its code reads b, h at all (if not, one tile table serves every batch entry or
    head). Compared and hashed by identity: one program per code and constants, so that two
    programs whose function is the same object (a mask_mod without arrays, whose global
    number changed) are still two specs and two sets of kernels."""
    __slots__ = ("function", "captured", "name", "reads_batch", "reads_head")

    def __init__(self, function, captured, name, reads=(True, True)):
        self.function, self.captured, self.name = function, tuple(captured), name
        self.reads_batch, self.reads_head = reads

    def __repr__(self):
        return f"MaskModProgram({self.name}, captured={self.captured})"


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
    defaults = _defaults(mask_mod)
    constants += [(f"{name}=", _constant_key(mask_mod, name, value)) for name, value in defaults]
    key = (mask_mod.__code__, tuple(constants), tuple(names))
    program = _programs.get(key)
    if program is None:
        program = MaskModProgram(_with_parameters(mask_mod, names, defaults) if names
                                 else mask_mod, names, _name(mask_mod),
                                 tuple(_reads_parameter(mask_mod.__code__, i) for i in (0, 1)))
        with _lock:
            if len(_programs) >= MAX_PROGRAMS:
                del _programs[next(iter(_programs))]
            program = _programs.setdefault(key, program)
    return program, tuple(arrays)


def _reads_parameter(code, position):
    """Whether code may read its parameter at `position`: any instruction that names it, but
    for one that only stores or deletes it, counts as a read (a load, a closure's cell of it,
    an opcode of a later Python). A parameter that arrives through *args is always read."""
    if position >= code.co_argcount:  # (*args: the tuple holds it)
        return True
    name = code.co_varnames[position]
    if name in code.co_cellvars:
        return True
    for instruction in dis.get_instructions(code):
        value = instruction.argval
        if instruction.opname in _ONLY_WRITES:
            continue
        if instruction.opname == "STORE_FAST_LOAD_FAST" and isinstance(value, tuple):
            # (3.13: stores value[0], loads value[1])
            value = value[1]
        if (value == name if isinstance(value, str)
                else isinstance(value, tuple) and name in value):  # (3.13's paired loads)
            return True
    return False


#: opcodes that name a local only to store or delete it
_ONLY_WRITES = frozenset(("STORE_FAST", "STORE_DEREF", "DELETE_FAST", "DELETE_DEREF",
                          "STORE_FAST_STORE_FAST", "STORE_FAST_MAYBE_NULL"))


def _defaults(mask_mod):
    """(name, default) of mask_mod's parameters after the four indices (keyword-only ones
    too): constants of the program, like the names it captures."""
    code = mask_mod.__code__
    positional = code.co_varnames[:code.co_argcount]
    defaults = mask_mod.__defaults__ or ()
    named = [(name, value) for name, value in zip(positional[len(positional) - len(defaults):],
                                                  defaults)
             if positional.index(name) >= 4]
    return named + sorted((mask_mod.__kwdefaults__ or {}).items())


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
    tuples of them) by type and repr (so that 1, True and 1.0, or 0.0 and -0.0, differ),
    anything else (functions, modules) by identity. An array mask_mod would reach through
    the value (inside a tuple, list or dict, through a module attribute, in a function it
    calls) would be compiled in as a constant: a TypeError."""
    if isinstance(value, _BY_VALUE):
        return type(value), repr(value)
    if isinstance(value, (tuple, list)) and all(isinstance(x, _BY_VALUE) for x in value):
        return type(value), tuple((type(x), repr(x)) for x in value)
    hidden = _array_within(value, mask_mod.__code__.co_names, set())
    if hidden:
        raise TypeError(f"mask_mod {_name(mask_mod)!r} reaches an array through {name!r} "
                        f"({hidden}): the kernels would hold it as a constant; capture each "
                        f"array by its own name in mask_mod itself")
    return _Same(value)


def _array_within(value, names, seen):
    """Where an array is reachable through value (None if nowhere): items of a tuple, list
    or dict, a module's attributes among `names`, what a function (or a Numba dispatcher's
    Python function) captures, recursively."""
    if id(value) in seen:
        return None
    seen.add(id(value))
    if isinstance(value, (tuple, list)):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    elif inspect.ismodule(value):
        items = ((n, getattr(value, n)) for n in names if hasattr(value, n))
    else:
        function = getattr(value, "py_func", value)  # (a cuda.jit device function)
        if not inspect.isfunction(function):
            return None
        items = _captured(function)
        names = function.__code__.co_names
    for label, item in items:
        if _is_array(item):
            return f"the array {label!r}"
        inner = _array_within(item, names, seen)
        if inner:
            return f"{label!r}: {inner}"
    return None


def _with_parameters(mask_mod, names, defaults):
    """mask_mod's code recompiled with `names` as trailing parameters after its four
    indices; its other captured names, and its parameters' defaults, as globals of the new
    function."""
    node = _definition(mask_mod)
    module = ast.parse("def _mask_mod_program():\n    pass\n")
    function = module.body[0]
    indices = (node.args.posonlyargs + node.args.args)[:4]
    function.args = ast.arguments(posonlyargs=[], args=indices + [ast.arg(arg=n) for n in names],
                                  vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None,
                                  defaults=[])
    body = [ast.Return(node.body)] if isinstance(node, ast.Lambda) else node.body
    fixed = [ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                        value=ast.Name(id=f"_default_{name}", ctx=ast.Load()))
             for name, _ in defaults]
    function.body = fixed + body
    ast.copy_location(function, node)
    module = ast.fix_missing_locations(module)
    namespace = {"__builtins__": mask_mod.__globals__.get("__builtins__", __builtins__)}
    namespace.update((name, value) for name, value in _captured(mask_mod)
                     if name not in names)
    namespace.update((f"_default_{name}", value) for name, value in defaults)
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
