"""Builds the orbitkv wheel (metadata in pyproject.toml).

The Python sources are copied as usual; then, for the interpreter running the build:
1. the main CMake tree (`build`, or $ORBITKV_BUILD_DIR) is built with exactly the flags scripts/test uses, so a tree
   scripts/test already built costs nothing and ccache serves the rest: orbitkv-manager, orbitkv and, when that tree's
   Python is this one, orbitkv._native;
2. for another Python (3.12 for the GPU machine), orbitkv._native alone is built in build-py<major><minor> (only the
   libraries the module needs);
3. the programs go to orbitkv/_bin, the module next to the package, and every shared library they link that a plain
   glibc system lacks to orbitkv/_libs, with UCX's transport modules in orbitkv/_libs/ucx; rpaths point there
   (patchelf), debug sections are stripped. The compiler runtime (libstdc++, libgcc_s), glibc and the RDMA stack
   (libibverbs, librdmacm: they must match the host's drivers) stay the system's.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution
from wheel.bdist_wheel import bdist_wheel

ROOT = pathlib.Path(__file__).resolve().parent
SYSTEM_LIB = re.compile(r"^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libresolv\.|libutil\."
                        r"|libstdc\+\+\.|libgcc_s\.|libibverbs\.|librdmacm\.|libmlx[45]\.|libnl-|libefa\.)")


# The Python the wheel is for: the one running the build, or $ORBITKV_WHEEL_PYTHON (the same platform, another
# CPython: 3.12 for the GPU machine, whose pip environment lacks setuptools; the build runs under Debian's Python).
TARGET_PYTHON = os.environ.get("ORBITKV_WHEEL_PYTHON") or sys.executable


@functools.lru_cache(maxsize=None)
def python_facts(python: str) -> tuple[str, str]:
    """(cpXY tag, extension suffix) of the interpreter `python` (asked once)."""
    out = subprocess.run([python, "-c", "import sys, sysconfig; print('cp%d%d' % sys.version_info[:2]); "
                          "print(sysconfig.get_config_var('EXT_SUFFIX'))"], check=True, text=True,
                         stdout=subprocess.PIPE).stdout.split()
    return out[0], out[1]


def target_facts() -> tuple[str, str]:
    return python_facts(TARGET_PYTHON)


def say(message: str) -> None:
    print(f"orbitkv wheel: {message}", file=sys.stderr, flush=True)


def run(command: list[str], **kwargs) -> str:
    return subprocess.run(command, check=True, text=True, stdout=subprocess.PIPE, **kwargs).stdout


def bootstrap_python() -> str:
    """The interpreter scripts/bootstrap recorded (the main tree's Python)."""
    env = ROOT / ".bootstrap" / "env"
    if env.exists():
        for line in env.read_text().splitlines():
            if line.startswith("ORBITKV_PYTHON="):
                return line.split("=", 1)[1]
    return "/usr/bin/python3"


def build_main_tree(build_dir: str, with_module: bool) -> None:
    targets = "orbitkv-manager orbitkv" + (" orbitkv_native" if with_module else "")
    say(f"building {targets} in {build_dir} (the scripts/test tree and flags)")
    script = ('source scripts/lib.sh && orbitkv_bootstrap && '
              f'ORBITKV_BUILD_TARGETS="{targets}" orbitkv_build "{build_dir}" "${{ORBITKV_MAIN_BUILD_ARGS[@]}}"')
    subprocess.run(["bash", "-c", script], check=True, cwd=ROOT, stdout=sys.stderr)


def build_module_tree(python: str) -> None:
    build_dir = ROOT / f"build-py{target_facts()[0][2:]}"
    say(f"building orbitkv._native for {python} in {build_dir.name}")
    args = ["-G", "Ninja", f"-DPython_EXECUTABLE={python}", f"-DPYTHON_EXECUTABLE={python}",
            "-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DORBITKV_BUILD_PYTHON=ON", "-DORBITKV_BUILD_TESTS=OFF",
            "-DORBITKV_BUILD_BENCHMARKS=OFF", "-DORBITKV_BUILD_FUZZERS=OFF", "-DORBITKV_WITH_UCX=OFF",
            "-DORBITKV_WITH_ETCD=OFF", "-DORBITKV_WITH_IO_URING=OFF", "-DORBITKV_WITH_CUDA=OFF"]
    env = dict(os.environ, CCACHE_NOHASHDIR="1")  # objects the main tree compiled are ccache hits here too
    if not (build_dir / "build.ninja").exists():
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args], check=True, env=env, stdout=sys.stderr)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "orbitkv_native", "--", f"-j{os.cpu_count()}"],
                   check=True, env=env, stdout=sys.stderr)


def elf_needs(path: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
    """(soname, resolved path) of every library `path` loads, transitively, that the system does not provide."""
    needs = []
    for line in run(["ldd", str(path)]).splitlines():
        parts = line.split()
        if "=>" not in parts:
            continue
        name, target = parts[0], parts[2]
        if SYSTEM_LIB.match(name):
            continue
        if target == "not":
            raise SystemExit(f"orbitkv wheel: {path.name} needs {name}, which this machine lacks "
                             "(run scripts/bootstrap)")
        needs.append((name, pathlib.Path(target)))
    return needs


def set_rpath(path: pathlib.Path, rpath: str) -> None:
    run(["patchelf", "--set-rpath", rpath, str(path)])


def strip(path: pathlib.Path) -> None:
    run(["objcopy", "--strip-debug", str(path)])


def bundle(package: pathlib.Path, build_dir: pathlib.Path, module: pathlib.Path) -> None:
    if shutil.which("patchelf") is None:
        raise SystemExit("orbitkv wheel: patchelf is missing; run scripts/bootstrap (it installs it)")
    bin_dir, lib_dir = package / "_bin", package / "_libs"
    for stale in (bin_dir, lib_dir):
        shutil.rmtree(stale, ignore_errors=True)
    bin_dir.mkdir()
    lib_dir.mkdir()
    for stale in package.glob("_native*.so"):
        stale.unlink()
    programs = [build_dir / "src" / "server" / "orbitkv-manager", build_dir / "tools" / "orbitkv"]
    staged = []
    for program in programs:
        shutil.copy2(program, bin_dir / program.name)
        staged.append((bin_dir / program.name, "$ORIGIN/../_libs"))
    shutil.copy2(module, package / module.name)
    staged.append((package / module.name, "$ORIGIN/_libs"))
    libraries: dict[str, pathlib.Path] = {}
    for path, _ in staged:
        libraries.update(elf_needs(path))
    # UCX finds its transport modules in <directory of libucs>/ucx, named lib<framework>_<module> plus libucs's own
    # suffix. Bundled next to the bundled libucs; a module whose system libraries are missing (InfiniBand without
    # rdma-core) is skipped by UCX at run time.
    ucx_modules = []
    if "libucs.so.0" in libraries:
        system_modules = libraries["libucs.so.0"].parent / "ucx"
        (lib_dir / "ucx").mkdir()
        for module_file in sorted(system_modules.glob("libuc[tm]_*.so.0")):
            target = lib_dir / "ucx" / module_file.name
            shutil.copy2(module_file, target)
            ucx_modules.append(target)
    module_names = {path.name for path in ucx_modules}
    for module_file in ucx_modules:
        for name, path in elf_needs(module_file):
            if name not in module_names:  # modules load each other from their own folder
                libraries.setdefault(name, path)
    for name, path in sorted(libraries.items()):
        shutil.copy2(path, lib_dir / name)  # follows links: the file under its soname
        (lib_dir / name).chmod(0o755)
        staged.append((lib_dir / name, "$ORIGIN"))
    for path in ucx_modules:
        staged.append((path, "$ORIGIN:$ORIGIN/.."))
    for path, rpath in staged:
        strip(path)
        set_rpath(path, rpath)
    say(f"bundled {len(programs)} programs, {module.name} and {len(libraries)} libraries "
        f"({len(ucx_modules)} UCX modules)")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], text=True, capture_output=True).stdout
    glibc = run(["ldd", "--version"]).splitlines()[0]
    (package / "_build_info.txt").write_text(
        f"commit: {commit.strip() or 'unknown'}\nbuilt with: {glibc}\npython: {target_facts()[0]}\n"
        f"libraries: {' '.join(sorted(libraries))}\n")


class BinaryDistribution(Distribution):
    """A platform wheel (native code inside), although setuptools compiles no extension itself."""

    def has_ext_modules(self) -> bool:
        return True


class BdistWheelForTarget(bdist_wheel):
    """Tags the wheel for TARGET_PYTHON (cpXY-cpXY-linux_x86_64)."""

    def get_tag(self):
        tag, _ = target_facts()
        return tag, tag, super().get_tag()[2]


class BuildPyWithNative(build_py):
    def run(self) -> None:
        super().run()
        build_dir = pathlib.Path(os.environ.get("ORBITKV_BUILD_DIR", "build"))
        if not build_dir.is_absolute():
            build_dir = ROOT / build_dir
        in_main_tree = python_facts(bootstrap_python())[0] == target_facts()[0]
        build_main_tree(str(build_dir), with_module=in_main_tree)
        if not in_main_tree:
            build_module_tree(TARGET_PYTHON)
        module = ROOT / "python" / "orbitkv" / ("_native" + target_facts()[1])
        if not module.exists():
            raise SystemExit(f"orbitkv wheel: the build left no {module}")
        bundle(pathlib.Path(self.build_lib) / "orbitkv", build_dir, module)


(ROOT / "build-wheel").mkdir(exist_ok=True)
setup(
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildPyWithNative, "bdist_wheel": BdistWheelForTarget},
    # setuptools' own build folders stay out of the CMake trees.
    options={"build": {"build_base": "build-wheel"}, "egg_info": {"egg_base": "build-wheel"}},
)
