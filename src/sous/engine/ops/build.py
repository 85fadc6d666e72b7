"""Builds (once) and loads the C++ CPU ops extension `sous_ops` (sources in `csrc/`).

`torch.utils.cpp_extension.load` compiles the sources with the host compiler (`-O3
-march=native -fopenmp`) into a cache directory and reuses the built module until a source or
flag changes. `make setup` runs `python -m sous.engine.ops.build` so that tests and servers never
pay for the compile. The directory is `$SOUS_OPS_BUILD_DIR`, else
`$XDG_CACHE_HOME/sous/ops/<torch version>-py<major><minor>-<cpu>` (default `~/.cache/sous/...`;
`<cpu>` hashes the CPU's feature flags, since `-march=native` code is only valid on such a CPU).

`$SOUS_OPS_CFLAGS` (space-separated) is appended to the compiler flags, e.g. `-mno-avx512f` to
build and test the portable (non-AVX-512) code paths; give such a build its own
`SOUS_OPS_BUILD_DIR`.

The OpenMP runtime is the one torch already loaded (both are `libgomp.so.1`), so the kernels run
on torch's thread pool and follow `torch.set_num_threads`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
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


def build_dir() -> Path:
    """Where the extension is built and cached (see module docstring)."""
    env = os.environ.get("SOUS_OPS_BUILD_DIR")
    if env:
        return Path(env)
    tag = f"{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}"
    return cache_root() / "ops" / f"{tag}-{_cpu_tag()}"


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


STALE_LOCK_S = 600.0
"""A build lock older than this is left over from a killed build (a cold build takes ~1 min)."""


def _remove_stale_lock(lock: Path) -> None:
    """cpp_extension waits forever on the lock file of a build that was killed; drop it."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("sous: removing a stale C++ ops build lock (%s, %.0f s old)", lock, age)
        lock.unlink(missing_ok=True)


def build(verbose: bool = False) -> ModuleType:
    """Compile (if needed) and import the extension; raises if the toolchain fails."""
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(out / "lock")
    return cpp_extension.load(
        name=NAME,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=[*CFLAGS, *os.environ.get("SOUS_OPS_CFLAGS", "").split()],
        extra_ldflags=["-fopenmp"],
        build_directory=str(out),
        verbose=verbose,
    )


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
