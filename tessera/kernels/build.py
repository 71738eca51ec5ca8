"""Just-in-time builds of the C++ kernels, shared by every kernel module, cached by a key.

`torch.utils.cpp_extension.load` compiles a source the first time it is asked for (~30-90 s a
kernel on two cores). It needs a C++ compiler and `ninja`. A failed build is logged once and
reported as None, so callers fall back to their torch path; `TESSERA_DISABLE_CPP_KERNELS=1` forces
that fallback.

How the cache is keyed. Each build has its own directory under `$TORCH_EXTENSIONS_DIR` (default
~/.cache/torch_extensions), named like the extension module it holds:

    tessera_fused_<key>/     tessera_fused_<key>.so, key.json, build.ninja, fused.o, locks

`key` hashes everything the binary depends on (`build_key`):

    source bytes                           a changed kernel never finds a stale binary
    compiler and linker flags
    torch version and git hash, C++ ABI,   the .so links against libtorch and the CPython ABI
    python tag (cpython-311)
    CPU flags (/proc/cpuinfo "flags")      -march=native: a build for one CPU can SIGILL on another

Why: the cache used to be one directory per kernel name, and ninja rebuilds when the source path
in it changes, so two checkouts on one machine rebuilt each other's kernels on every start (a new
user paid a silent 96-119 s rebuild on 5 of 6 starts), and a cache copied to another CPU could
crash with SIGILL. Now two checkouts with the same sources share one build, and different sources,
torch builds or CPUs never share a directory. Old directories are never deleted (another checkout
may still use them); deleting any of them is safe and costs one rebuild.

A finished build writes `key.json` (the hashed inputs, to read when debugging) next to its .so, and
a start that finds it imports the .so directly: no ninja, no compiler check, no lock, since nothing
rewrites a finished build (each kernel loads in a fraction of a second warm). A start that does not
find it
takes an flock on the directory first, so of two processes starting at once one builds, the other
logs that it waits and then imports the same .so. An flock dies with its process; torch's own
`lock` file does not, and a build killed mid-way leaves one that would make every later start wait
forever, so under the flock it is removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

# -march=native: the kernels use AVX-512 where the CPU has it; the key holds the CPU flags.
# -fopenmp: at::parallel_for in the kernels is an OpenMP loop; without it it runs on one thread.
# Tuples, and load() gets copies: it appends torch's own -L/-l flags to the list it is given,
# which changed the key of every kernel loaded after the first in a process.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# One kernel cold: 30-40 s of CPU; 54-95 s wall, measured on two cores shared with other builds.
_BUILD_SECONDS = "30-90"
_DONE = "key.json"

_built: dict[str, ModuleType | None] = {}


def load_extension(name: str, source: Path, depends: Sequence[Path] = ()) -> ModuleType | None:
    """The compiled module for `source` (built once per key), or None if it cannot be built.

    `depends`: headers the source includes; their bytes join the key, so editing one rebuilds."""
    if name in _built:
        return _built[name]
    module = None
    if not os.environ.get("TESSERA_DISABLE_CPP_KERNELS"):
        try:
            module = _load_cached(name, source, depends)
        except Exception as e:  # compiler, ninja or header problems: run on the torch path instead
            logger.warning("C++ kernel %s unavailable, using the torch fallback: %s", name, e)
    _built[name] = module
    return module


def build_key(source: bytes, cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """16 hex digits naming one build; the same in every process and checkout for equal inputs."""
    return _digest(_key_inputs(source, cflags, ldflags))


def _key_inputs(source: bytes, cflags: Sequence[str], ldflags: Sequence[str]) -> dict[str, object]:
    return {
        "source_sha256": hashlib.sha256(source).hexdigest(),
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "torch": str(torch.__version__),
        "torch_git": torch.version.git_version,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": sys.implementation.cache_tag,
        "machine": platform.machine(),
        "cpu_flags": _cpu_flags(),
    }


def _digest(inputs: dict[str, object]) -> str:
    # json with sorted keys, not hash(): hash() of a str differs between processes
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's feature flags, sorted (x86 "flags", arm "Features"); else platform's CPU name."""
    try:
        with open(cpuinfo) as f:
            for line in f:  # the first core's line is enough: all cores of a machine match
                field, _, value = line.partition(":")
                if field.strip() in ("flags", "Features"):
                    return " ".join(sorted(value.split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_root() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _load_cached(name: str, source: Path, depends: Sequence[Path] = ()) -> ModuleType:
    # headers are appended to the source bytes: a changed header is a changed build
    text = source.read_bytes() + b"".join(b"\0" + dep.read_bytes() for dep in depends)
    inputs = _key_inputs(text, CFLAGS, LDFLAGS)
    ext_name = f"{name}_{_digest(inputs)}"  # a valid module name: the .cpp's PyInit_ uses it
    build_dir = _cache_root() / ext_name
    if (build_dir / _DONE).exists():
        return _import(ext_name, build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(build_dir, name):
        if (build_dir / _DONE).exists():  # another process built it while we waited
            return _import(ext_name, build_dir)
        (build_dir / "lock").unlink(missing_ok=True)  # torch's baton, left by a killed build
        logger.warning(
            "building C++ kernel %s (first start on this machine, ~%s s) in %s",
            name, _BUILD_SECONDS, build_dir,
        )
        start = time.monotonic()
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name=ext_name,
            sources=[str(source)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            verbose=False,
        )
        tmp = build_dir / f"{_DONE}.{os.getpid()}"
        tmp.write_text(json.dumps(inputs, indent=1, sort_keys=True))
        os.replace(tmp, build_dir / _DONE)  # atomic: a reader sees no key.json or a whole one
        logger.warning("built C++ kernel %s in %.0f s", name, time.monotonic() - start)
        return module


@contextmanager
def _exclusive(build_dir: Path, name: str) -> Iterator[None]:
    """Hold an flock on `build_dir` (released when the file closes, or the process dies)."""
    with open(build_dir / "tessera.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("C++ kernel %s: waiting for another process to build it", name)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _import(ext_name: str, build_dir: Path) -> ModuleType:
    """Import a finished build, as torch's load does after a build."""
    spec = importlib.util.spec_from_file_location(ext_name, build_dir / f"{ext_name}.so")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
