"""The console scripts of the wheel: ``orbitkv-manager`` and ``orbitkv`` run the programs bundled in the orbitkv
package (``orbitkv/_bin``, their shared libraries in ``orbitkv/_libs``). A module of its own: starting the daemon
must not import the package (numpy, the native module), which a bare service environment may lack."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys


def _package_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("orbitkv")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("orbitkv is not installed in this Python environment")
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def binary(name: str) -> pathlib.Path:
    """The bundled program ``name``; SystemExit naming the fix when this installation has none (a source tree)."""
    path = _package_dir() / "_bin" / name
    if not os.access(path, os.X_OK):
        raise SystemExit(f"{name}: this orbitkv installation has no {path} (it is not from the wheel); install the "
                         f"wheel (pip install orbitkv-*.whl) or run {name} from a CMake build tree")
    return path


def _exec(name: str) -> None:
    path = binary(name)
    os.execv(path, [name, *sys.argv[1:]])


def manager() -> None:
    _exec("orbitkv-manager")


def cli() -> None:
    _exec("orbitkv")
