"""Builds (once) and loads the C++ CPU ops extension `sous_ops` (sources in `csrc/`).

`torch.utils.cpp_extension.load` compiles the sources with the host compiler (`-O3
-march=native -fopenmp`) into a cache directory. `make setup` runs `python -m
sous.engine.ops.build` so that tests and servers never pay for the compile. The directory is
`$SOUS_OPS_BUILD_DIR`, else `$XDG_CACHE_HOME/sous/ops/<torch>-py<ver>-<cpu>-<key>` (default
`~/.cache/sous/...`): `<cpu>` hashes the CPU's feature flags (`-march=native` code is only valid
on such a CPU) and `<key>` the sources and flags, so every checkout with the same sources shares
one build. The sources are copied into the directory and compiled from there (the build never
depends on where the checkout lives).

Contract of the directory: `sous_ops.so` is complete once `built` holds the key; a process that
finds that loads the module directly (no compiler, no lock). Building happens under an `flock`
on `.flock`, which the kernel releases when its holder dies, so a build killed half-way never
makes later processes wait: cpp_extension's own `lock` file is removed under it.

`$SOUS_OPS_CFLAGS` (space-separated) is appended to the compiler flags, e.g. `-mno-avx512f` to
build and test the portable (non-AVX-512) code paths; it is part of `<key>`.

The OpenMP runtime is the one torch already loaded (both are `libgomp.so.1`), so the kernels run
on torch's thread pool and follow `torch.set_num_threads`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from sous.user_cache import cache_root

logger = logging.getLogger(__name__)

NAME = "sous_ops"
CSRC = Path(__file__).with_name("csrc")
SOURCES = ("attention.cpp", "gqa.cpp", "index_scores.cpp", "threads.cpp", "quant.cpp",
           "qgemm.cpp", "qgemm_rows.cpp", "layer_ops.cpp", "llama_stack.cpp", "bindings.cpp")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-DNDEBUG")
STAMP = "built"


def _cflags() -> list[str]:
    return [*CFLAGS, *os.environ.get("SOUS_OPS_CFLAGS", "").split()]


def build_key() -> str:
    """Hash of every file in `csrc/`, the compiler flags and the torch/Python versions."""
    h = hashlib.sha1()
    for f in sorted(CSRC.iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(" ".join(_cflags()).encode())
    h.update(f"{torch.__version__}-{sys.version_info[:2]}".encode())
    return h.hexdigest()[:12]


def build_dir() -> Path:
    """Where the extension is built and cached (see module docstring)."""
    env = os.environ.get("SOUS_OPS_BUILD_DIR")
    if env:
        return Path(env)
    tag = f"{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}"
    return cache_root() / "ops" / f"{tag}-{_cpu_tag()}-{build_key()}"


def _cpu_tag() -> str:
    """Short hash of the machine type and CPU feature flags (Linux `/proc/cpuinfo`)."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the `ninja` wheel may live only in this venv."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """Exclusive `flock` on `out/.flock` (released by the kernel if this process dies)."""
    with open(out / ".flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _import_built(out: Path, key: str) -> ModuleType | None:
    """The module from a finished build in `out` for `key`, else None."""
    so = out / f"{NAME}.so"
    try:
        if (out / STAMP).read_text().strip() != key or not so.is_file():
            return None
    except FileNotFoundError:
        return None
    spec = importlib.util.spec_from_file_location(NAME, so)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(verbose: bool = False) -> ModuleType:
    """Compile (if needed) and import the extension; raises if the toolchain fails."""
    key = build_key()
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    if (mod := _import_built(out, key)) is not None:
        return mod
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    with _build_lock(out):
        if (mod := _import_built(out, key)) is not None:  # built while we waited
            return mod
        (out / "lock").unlink(missing_ok=True)  # cpp_extension's, left by a killed build
        src = out / "src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(CSRC, src)
        (out / STAMP).unlink(missing_ok=True)
        mod = cpp_extension.load(
            name=NAME,
            sources=[str(src / s) for s in SOURCES],
            extra_cflags=_cflags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(out),
            verbose=verbose,
        )
        (out / STAMP).write_text(key + "\n")
    return mod


@functools.cache
def load() -> ModuleType | None:
    """The extension, or None (with one warning line) when it cannot be built here."""
    try:
        mod = build()
    except Exception as e:  # noqa: BLE001 - any toolchain failure means "use the torch path"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        logger.warning("sous: C++ attention ops unavailable (%s); using the torch path "
                       "(SOUS_ATTENTION=torch skips the build)", first)
        return None
    logger.debug("sous_ops C++ attention kernels: %s", mod.__file__)
    return mod


@functools.cache
def _cpu_ops() -> ModuleType | None:
    if os.environ.get("SOUS_ATTENTION", "").strip().lower() == "torch":
        return None
    return load()


def cpu_ops(device: torch.device | str = "cpu") -> ModuleType | None:
    """The extension for tensors on `device`, or None: not the CPU, `SOUS_ATTENTION=torch`
    (every C++ kernel off; read once per process), or no build here."""
    return _cpu_ops() if torch.device(device).type == "cpu" else None


def cpu_ops_for(x: torch.Tensor) -> ModuleType | None:
    """`cpu_ops(x.device)`, cheaper (per-layer hot path)."""
    return _cpu_ops() if x.is_cpu else None


def main() -> int:
    """`python -m sous.engine.ops.build [-v]`: build the extension now, print its path."""
    mod = build(verbose="-v" in sys.argv[1:])
    print(f"{NAME}: {mod.__file__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
