"""Test setup: import orbitkv from the source tree (python/) and locate the CMake build directory."""

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))


@pytest.fixture(scope="session")
def root() -> pathlib.Path:
    return ROOT


@pytest.fixture(scope="session")
def build_dir() -> pathlib.Path:
    path = ROOT / os.environ.get("ORBITKV_BUILD_DIR", "build")
    if not (path / "build.ninja").exists():
        pytest.fail(f"no CMake build in {path}: run scripts/test (it builds before running pytest)")
    return path
