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
    instruction set (TESSERA_CPU_ISA)      avx512 | avx2 | portable: each is its own build
    CPU flags (/proc/cpuinfo "flags")      only for -march=native (avx512): a build for one CPU
                                           can SIGILL on another; avx2 and portable builds name
                                           a fixed target and are shared by every CPU that has it

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
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

# Which instruction set the kernels are built for, picked at run time (cpu_isa):
#   avx512    -march=native on a CPU with AVX-512 F/BW/VL/DQ: the hand-written AVX-512 paths, plus
#             VNNI, bf16 and AMX where this CPU has them
#   avx2      -march=x86-64-v3 (AVX2, FMA, F16C, BMI2): Zen 2/3, Intel client chips; the same
#             binary serves every such CPU
#   portable  no -march: no x86 intrinsics; plain C++ the compiler vectorizes for the base target
#             (SSE2 on x86-64, NEON on aarch64), correct anywhere
# TESSERA_CPU_ISA forces one no higher than the CPU's, so an AVX-512 machine builds and tests
# the AVX2 and portable paths too. CPU_CAPABILITY_* selects at::vec's width (kernel_vec.h).
ISAS = ("avx512", "avx2", "portable")
_ISA_CFLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("-march=native", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"),
    "avx2": ("-march=x86-64-v3", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"),
    "portable": ("-DTESSERA_PORTABLE=1", "-DCPU_CAPABILITY=DEFAULT"),
}
# x86 flags each ISA needs (Linux /proc/cpuinfo spelling)
_ISA_NEEDS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
    "portable": (),
}
# -fopenmp: at::parallel_for in the kernels is an OpenMP loop; without it it runs on one thread
# (and `#pragma omp simd` reductions vectorize the portable loops).
# Tuples, and load() gets copies: it appends torch's own -L/-l flags to the list it is given,
# which changed the key of every kernel loaded after the first in a process.
_BASE_CFLAGS = ("-O3", "-fopenmp")
CFLAGS = (*_BASE_CFLAGS, *_ISA_CFLAGS["avx512"])  # the flags of an AVX-512 build
LDFLAGS = ("-fopenmp",)
_BUILD_SECONDS = "30-90"
# the vector layer every avx2/portable path is written on (its choice is argued there)
VEC_HEADER = Path(__file__).with_name("kernel_vec.h")
_DONE = "key.json"

_built: dict[tuple[str, str], ModuleType | None] = {}


def load_extension(name: str, source: Path, depends: Sequence[Path] = ()) -> ModuleType | None:
    """The compiled module for `source` (built once per key), or None if it cannot be built.

    `depends`: headers the source includes; their bytes join the key, so editing one rebuilds."""
    isa = cpu_isa()  # raises ValueError on a bad TESSERA_CPU_ISA: that is the user's to fix
    if (name, isa) in _built:
        return _built[(name, isa)]
    module = None
    if not os.environ.get("TESSERA_DISABLE_CPP_KERNELS"):
        try:
            _check_toolchain()
            module = _load_cached(name, source, depends, cflags_for(isa))
        except Exception as e:  # compiler, ninja or header problems: run on the torch path instead
            logger.warning("C++ kernel %s unavailable, using the torch fallback: %s", name, e)
    _built[(name, isa)] = module
    return module


def supported_isas(flags: str | None = None, machine: str | None = None) -> list[str]:
    """The instruction sets this CPU can run, best first (always ends with "portable")."""
    return list(_isas_of(_cpu_flags() if flags is None else flags,
                         machine or platform.machine()))


@functools.lru_cache(maxsize=16)
def _isas_of(flags: str, machine: str) -> tuple[str, ...]:
    if machine not in ("x86_64", "AMD64"):
        return ("portable",)
    have = set(flags.split())
    return tuple(isa for isa in ISAS if all(f in have for f in _ISA_NEEDS[isa]))


def cpu_isa() -> str:
    """The instruction set the kernels are built for: TESSERA_CPU_ISA if set (it may only lower
    the choice), else the best this CPU runs."""
    supported = supported_isas()
    forced = os.environ.get("TESSERA_CPU_ISA", "").strip().lower()
    if not forced:
        return supported[0]
    if forced not in ISAS:
        raise ValueError(f"TESSERA_CPU_ISA={forced!r}: expected one of {', '.join(ISAS)}")
    if forced not in supported:
        raise ValueError(
            f"TESSERA_CPU_ISA={forced!r}: this CPU lacks it (it runs {', '.join(supported)})"
        )
    return forced


def cflags_for(isa: str) -> tuple[str, ...]:
    """Compiler flags of a build for `isa` (one of ISAS)."""
    return (*_BASE_CFLAGS, *_ISA_CFLAGS[isa])


def _check_toolchain() -> None:
    """A clear error when there is nothing to build with (torch's own is a bare FileNotFoundError
    or a ninja traceback)."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(
            f"no C++ compiler found (looked for {cxx!r}; set CXX or install one, e.g. "
            "`apt-get install g++`); TESSERA_DISABLE_CPP_KERNELS=1 silences this"
        )
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        raise RuntimeError("ninja not found: `pip install ninja` (the C++ kernels build with it)")


def build_key(source: bytes, cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """16 hex digits naming one build; the same in every process and checkout for equal inputs."""
    return _digest(_key_inputs(source, cflags, ldflags))


def _key_inputs(source: bytes, cflags: Sequence[str], ldflags: Sequence[str]) -> dict[str, object]:
    return {
        "source_sha256": hashlib.sha256(source).hexdigest(),
        "isa": _isa_of(cflags),
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "torch": str(torch.__version__),
        "torch_git": torch.version.git_version,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": sys.implementation.cache_tag,
        "machine": platform.machine(),
        # a native build is for this CPU only; a fixed target (-march=x86-64-v3, none) is not
        "cpu_flags": _cpu_flags() if "-march=native" in cflags else "",
    }


def _isa_of(cflags: Sequence[str]) -> str:
    for isa in ("avx2", "avx512"):
        if f"-DCPU_CAPABILITY_{isa.upper()}" in cflags:
            return isa
    return "portable" if "-DTESSERA_PORTABLE=1" in cflags else "other"


def _digest(inputs: dict[str, object]) -> str:
    # json with sorted keys, not hash(): hash() of a str differs between processes
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=8)
def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's feature flags, sorted (x86 "flags", arm "Features"); else platform's CPU name.
    Cached: every kernel call asks which build serves it (`cpu_isa`), and reading /proc/cpuinfo
    costs tens of microseconds to milliseconds on a VM, 30 times a decode step."""
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


def _load_cached(
    name: str, source: Path, depends: Sequence[Path] = (), cflags: Sequence[str] = CFLAGS
) -> ModuleType:
    # headers are appended to the source bytes: a changed header is a changed build
    text = source.read_bytes() + b"".join(b"\0" + dep.read_bytes() for dep in depends)
    inputs = _key_inputs(text, cflags, LDFLAGS)
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
            "building C++ kernel %s for %s (first start on this machine, ~%s s) in %s",
            name, inputs["isa"], _BUILD_SECONDS, build_dir,
        )
        start = time.monotonic()
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name=ext_name,
            sources=[str(source)],
            extra_cflags=list(cflags),
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
