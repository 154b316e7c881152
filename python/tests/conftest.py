"""Test setup: import orbitkv from the source tree (python/) and locate the CMake build directory."""

import os
import pathlib
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

# The harnesses "download" models into a Hugging Face hub cache as vLLM does; the connector caches weight
# digests under XDG_CACHE_HOME. Both live in a private directory, never the user's own caches.
_CACHES = tempfile.mkdtemp(prefix="orbitkv-test-caches-")
os.environ["HF_HUB_CACHE"] = os.path.join(_CACHES, "hub")
os.environ["XDG_CACHE_HOME"] = os.path.join(_CACHES, "xdg")
os.environ.pop("HF_HOME", None)


@pytest.fixture(autouse=True)
def _vllm_scheduler_detection():
    """Each test starts with the adapters' own detection of the engine (vLLM's scheduler, SGLang's server args),
    which a harness may override."""
    yield
    try:
        from orbitkv.vllm import _compat
    except ImportError:
        return
    _compat.set_scheduler_recovers_hybrid(None)
    from orbitkv.sglang import _compat as sglang_compat

    sglang_compat.set_server_args(None)  # SGLang's global server args, which a harness may have installed


@pytest.fixture(scope="session")
def root() -> pathlib.Path:
    return ROOT


@pytest.fixture(scope="session")
def build_dir() -> pathlib.Path:
    path = ROOT / os.environ.get("ORBITKV_BUILD_DIR", "build")
    if not (path / "build.ninja").exists():
        pytest.fail(f"no CMake build in {path}: run scripts/test (it builds before running pytest)")
    return path
