"""Importing is cheap and clean; the backends folder installs only as numba_flash.backends."""
import importlib.util
import subprocess
import sys


def test_import_loads_neither_numba_cuda_nor_cupy_nor_torch():
    code = ("import sys, numba_flash; numba_flash.list_backends(); "
            "print(sorted(m for m in ('numba', 'numba.cuda', 'cupy', 'torch') "
            "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert run.stdout.strip() == "[]"


def test_backends_is_a_subpackage_not_a_top_level_module():
    assert importlib.util.find_spec("numba_flash.backends") is not None
    code = "import importlib.util; print(importlib.util.find_spec('backends'))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd="/")
    assert run.stdout.strip() == "None"


def test_public_names():
    import numba_flash
    for name in ("forward", "backward", "attention", "list_backends", "available_backends",
                 "get_backend", "select_backend", "use_backend"):
        assert callable(getattr(numba_flash, name)), name


def test_setup_cfg_lists_every_package():
    """A non-editable install carries only the packages setup.cfg lists (an engine package
    missing there installed a backend that could not import its engine)."""
    import configparser
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    found = set()
    for folder, name in (("numba_flash", "numba_flash"), ("backends", "numba_flash.backends")):
        for init in (root / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(root / folder).parts
            found.add(".".join((name, *parts)))
    assert found == listed, (sorted(found - listed), sorted(listed - found))
