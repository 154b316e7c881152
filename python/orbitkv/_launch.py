"""The console scripts of the wheel: ``orbitkv-manager`` and ``orbitkv`` run the programs bundled in the package
(``orbitkv/_bin``, their shared libraries in ``orbitkv/_libs``)."""

from __future__ import annotations

import os
import pathlib
import sys

BIN = pathlib.Path(__file__).resolve().with_name("_bin")


def binary(name: str) -> pathlib.Path:
    """The bundled program ``name``; SystemExit naming the fix when this installation has none (a source tree)."""
    path = BIN / name
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
