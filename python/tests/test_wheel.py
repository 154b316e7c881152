"""The wheel as a user installs it: built from this tree (pip wheel --no-build-isolation), installed into a fresh venv
with Debian's torch and numpy (--system-site-packages), the Manager started from its console script, and a
save/query/restore through orbitkv.CacheManagerClient from that venv (python -m orbitkv.selftest), byte-exact, none of
it from the source tree."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SYSTEM = re.compile(r"^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+\.|libgcc_s\.)")



@pytest.fixture(scope="module")
def wheel(tmp_path_factory, build_dir):
    out = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ, ORBITKV_BUILD_DIR=str(build_dir))
    env.pop("ORBITKV_WHEEL_PYTHON", None)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-q",
                    "-w", str(out), str(ROOT)], check=True, cwd=ROOT, env=env)
    wheels = list(out.glob("orbitkv-*.whl"))
    assert len(wheels) == 1, wheels
    tag = "cp%d%d" % sys.version_info[:2]
    assert wheels[0].name.endswith(f"-{tag}-{tag}-linux_x86_64.whl"), wheels[0].name
    return wheels[0]


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel):
    home = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(home)], check=True)
    subprocess.run([str(home / "bin" / "pip"), "install", "-q", "--no-index", "--no-deps", str(wheel)], check=True)
    return home


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH", "ORBITKV_SOCKET")}
    return env


def test_the_installed_programs_load_their_libraries_from_the_wheel(venv):
    site = next((venv / "lib").glob("python3.*/site-packages/orbitkv"))
    elves = [site / "_bin" / "orbitkv-manager", site / "_bin" / "orbitkv", *site.glob("_native*.so"),
             *(site / "_libs" / "ucx").glob("*.so.0")]
    assert len(elves) >= 4
    for elf in elves:
        for line in subprocess.run(["ldd", str(elf)], check=True, text=True, capture_output=True,
                                   env=clean_env()).stdout.splitlines():
            parts = line.split()
            if "=>" not in parts or SYSTEM.match(parts[0]):
                continue
            assert parts[2] != "not", f"{elf.name}: {line.strip()}"
            if elf.parent.name == "ucx" and parts[0].startswith(("libibverbs", "librdmacm", "libmlx", "libnl-")):
                continue  # the RDMA stack is the host's
            assert parts[2].startswith(str(site)), f"{elf.name} loads {parts[0]} from outside the wheel: {parts[2]}"
    assert (site / "_build_info.txt").read_text().startswith("commit: ")


def test_the_daemon_starts_from_an_environment_without_numpy(wheel, tmp_path):
    """A service environment has no engine in it: the console script runs the bundled Manager without importing the
    package (numpy, the native module)."""
    bare = tmp_path / "bare"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(bare)], check=True)
    assert subprocess.run([str(bare / "bin" / "python"), "-c", "import numpy"], capture_output=True).returncode != 0
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bare / "bin" / "python"), "install", "-q",
                    "--no-index", "--no-deps", str(wheel)], check=True)
    version = subprocess.run([str(bare / "bin" / "orbitkv-manager"), "--version"], capture_output=True, text=True,
                             env=clean_env(), cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("orbitkv-manager "), version.stderr


def test_console_scripts_and_a_byte_exact_round_trip_from_the_venv(venv, tmp_path):
    env = clean_env()
    help_text = subprocess.run([str(venv / "bin" / "orbitkv-manager"), "--help"], check=True, text=True,
                               capture_output=True, env=env, cwd=tmp_path).stdout
    assert "--check-config" in help_text and "--etcd-endpoints" in help_text
    sock = tmp_path / "manager.sock"
    manager = subprocess.Popen([str(venv / "bin" / "orbitkv-manager"), "--socket", str(sock), "--dram", "64MiB",
                                "--slab", "4MiB", "--log-level", "warn"], env=env, cwd=tmp_path,
                               stderr=subprocess.PIPE, text=True)
    try:
        # orbitkv.selftest (the installed one): saves, poisons, queries and restores shared-memory pages, byte-exact.
        ran = subprocess.run([str(venv / "bin" / "python"), "-m", "orbitkv.selftest", "--socket", str(sock),
                              "--device", "cpu"], env=env, cwd=tmp_path, text=True, capture_output=True, timeout=120)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert f"selftest: orbitkv from {venv}" in ran.stdout  # the installed package, not the tree's
        assert "selftest: shared memory: 8 pages byte-exact" in ran.stdout
        stats = subprocess.run([str(venv / "bin" / "orbitkv"), "stats", "--socket", str(sock), "--json"],
                               env=env, cwd=tmp_path, text=True, capture_output=True, timeout=30)
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["resident_blocks"] == 8  # the CLI from the wheel reads the same Manager
        status = subprocess.run([str(venv / "bin" / "orbitkv"), "status", "--socket", str(sock)], env=env,
                                cwd=tmp_path, text=True, capture_output=True, timeout=30)
        assert status.returncode == 0, status.stderr
        assert "pool arenas on NUMA node(s) " in status.stdout and "GPUs served: " in status.stdout, status.stdout
    finally:
        manager.send_signal(signal.SIGTERM)
        assert manager.wait(timeout=60) == 0, manager.stderr.read()
