"""The keyed kernel cache of tessera/kernels/build.py: what the key depends on, and what a cold
start, a warm start and a start that waits for another process's build do. `load` is replaced by a
fake here (a real build takes a minute); the one test that compiles (a tiny source) is slow."""

from __future__ import annotations

import fcntl
import logging
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils import cpp_extension

import tessera
from tessera.kernels import build

REPO = Path(tessera.__file__).parents[1]
SOURCE = b"// kernel v1\n"
CFLAGS = ["-O3", "-march=native"]
LDFLAGS = ["-fopenmp"]


def test_same_inputs_same_key_in_another_process():
    key = build.build_key(SOURCE, CFLAGS, LDFLAGS)
    code = (
        "from tessera.kernels.build import build_key; "
        f"print(build_key({SOURCE!r}, {CFLAGS!r}, {LDFLAGS!r}))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "random"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == key
    assert len(key) == 16 and f"tessera_fused_{key}".isidentifier()


@pytest.mark.parametrize(
    "change",
    ["source", "cflags", "ldflags", "torch", "torch_git", "cxx11_abi", "python", "cpu_flags"],
)
def test_key_changes_with_each_input(change, monkeypatch):
    source, cflags, ldflags = SOURCE, list(CFLAGS), list(LDFLAGS)
    before = build.build_key(source, cflags, ldflags)
    assert build.build_key(source, cflags, ldflags) == before
    if change == "source":
        source = b"// kernel v2\n"
    elif change == "cflags":
        cflags = ["-O2", "-march=native"]
    elif change == "ldflags":
        ldflags = []
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.1+other")
    elif change == "torch_git":
        monkeypatch.setattr(torch.version, "git_version", "0" * 40)
    elif change == "cxx11_abi":
        abi = torch._C._GLIBCXX_USE_CXX11_ABI
        monkeypatch.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not abi)
    elif change == "python":
        monkeypatch.setattr(sys, "implementation", _Implementation("cpython-399"))
    else:
        monkeypatch.setattr(build, "_cpu_flags", lambda: "sse2 avx2")
    assert build.build_key(source, cflags, ldflags) != before


class _Implementation:
    def __init__(self, cache_tag: str):
        self.cache_tag = cache_tag


def test_cpu_flags_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: sse2 avx512f avx\nbugs\t\t: spectre_v1\n")
    assert build._cpu_flags(str(x86)) == "avx avx512f sse2"
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert build._cpu_flags(str(arm)) == "asimd fp sve"
    missing = build._cpu_flags(str(tmp_path / "missing"))
    assert missing and missing == (platform.processor() or platform.machine())


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(),
                    reason="x86 Linux only")
def test_cpu_flags_of_this_machine():
    assert "sse2" in build._cpu_flags().split()


class FakeLoad:
    """Stands in for cpp_extension.load; appends to extra_ldflags in place, as torch's does."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, **kwargs):
        assert not (Path(kwargs["build_directory"]) / "lock").exists(), "stale baton not removed"
        kwargs["extra_ldflags"] += ["-ltorch"]
        self.calls.append(kwargs)
        return ModuleType(kwargs["name"])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty TORCH_EXTENSIONS_DIR, no module built in this process, and a fake `load`."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("TESSERA_DISABLE_CPP_KERNELS", raising=False)
    monkeypatch.delenv("TESSERA_CPU_ISA", raising=False)
    monkeypatch.setattr(build, "_built", {})
    fake = FakeLoad()
    monkeypatch.setattr(cpp_extension, "load", fake)
    return fake


def _source(tmp_path: Path, text: bytes = SOURCE) -> Path:
    path = tmp_path / "dummy.cpp"
    path.write_bytes(text)
    return path


def _dir_for(tmp_path: Path, name: str, source: bytes = SOURCE) -> Path:
    cflags = build.cflags_for(build.cpu_isa())
    return tmp_path / "ext" / f"{name}_{build.build_key(source, cflags, build.LDFLAGS)}"


def test_cold_start_logs_and_builds_in_the_keyed_directory(cache, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=build.__name__)
    module = build.load_extension("tessera_dummy", _source(tmp_path))
    build_dir = _dir_for(tmp_path, "tessera_dummy")
    assert len(cache.calls) == 1 and module is not None and module.__name__ == build_dir.name
    assert cache.calls[0]["name"] == build_dir.name
    assert cache.calls[0]["build_directory"] == str(build_dir)
    assert (build_dir / "key.json").exists()
    first = (f"building C++ kernel tessera_dummy for {build.cpu_isa()} "
             "(first start on this machine, ~")
    assert first in caplog.text
    assert "built C++ kernel tessera_dummy in " in caplog.text


def test_second_kernel_key_unchanged_by_the_first_build(cache, tmp_path):
    # torch's load appends to the ldflags it is given; the next kernel's key must not see that
    other = tmp_path / "other.cpp"
    other.write_bytes(b"// other\n")
    expected = _dir_for(tmp_path, "tessera_other", b"// other\n")
    build.load_extension("tessera_dummy", _source(tmp_path))
    build.load_extension("tessera_other", other)
    assert cache.calls[1]["build_directory"] == str(expected)


def test_warm_start_imports_without_building(cache, tmp_path, monkeypatch, caplog):
    source = _source(tmp_path)
    build.load_extension("tessera_dummy", source)
    monkeypatch.setattr(build, "_built", {})  # a fresh process
    imported = []
    monkeypatch.setattr(build, "_import", lambda name, d: imported.append((name, d)) or "module")
    caplog.set_level(logging.INFO, logger=build.__name__)
    caplog.clear()
    assert build.load_extension("tessera_dummy", source) == "module"
    build_dir = _dir_for(tmp_path, "tessera_dummy")
    assert imported == [(build_dir.name, build_dir)]
    assert len(cache.calls) == 1 and "building" not in caplog.text


def test_changed_source_builds_in_a_new_directory(cache, tmp_path, monkeypatch):
    build.load_extension("tessera_dummy", _source(tmp_path))
    monkeypatch.setattr(build, "_built", {})
    build.load_extension("tessera_dummy", _source(tmp_path, b"// kernel v2\n"))
    dirs = [call["build_directory"] for call in cache.calls]
    assert len(dirs) == 2 and dirs[0] != dirs[1]
    assert all((Path(d) / "key.json").exists() for d in dirs)


def test_stale_torch_lock_is_removed_before_a_build(cache, tmp_path):
    build_dir = _dir_for(tmp_path, "tessera_dummy")
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # left by a build that was killed
    assert build.load_extension("tessera_dummy", _source(tmp_path)) is not None  # FakeLoad checks


class _SetOnWaiting(logging.Handler):
    def __init__(self):
        super().__init__()
        self.waiting = threading.Event()

    def emit(self, record):
        if "waiting for another process" in record.getMessage():
            self.waiting.set()


def test_a_start_that_waits_for_another_build_does_not_rebuild(cache, tmp_path, monkeypatch):
    source = _source(tmp_path)
    build_dir = _dir_for(tmp_path, "tessera_dummy")
    build_dir.mkdir(parents=True)
    monkeypatch.setattr(build, "_import", lambda name, d: "module")
    handler = _SetOnWaiting()
    build.logger.addHandler(handler)
    result = []
    try:
        with open(build_dir / "tessera.lock", "a") as other_process:
            fcntl.flock(other_process, fcntl.LOCK_EX)
            thread = threading.Thread(
                target=lambda: result.append(build.load_extension("tessera_dummy", source))
            )
            thread.start()
            assert handler.waiting.wait(timeout=30)
            (build_dir / "key.json").write_text("{}")  # the other process finished its build
        thread.join(timeout=30)
    finally:
        build.logger.removeHandler(handler)
    assert result == ["module"] and cache.calls == []


TINY_SOURCE = """
#include <pybind11/pybind11.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""

LOAD_SCRIPT = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(message)s")
from tessera.kernels.build import load_extension
print(load_extension("tessera_tiny", Path(sys.argv[1])).answer())
"""


def test_two_processes_starting_at_once_build_once_then_warm(tmp_path):
    """Really compiles (a few seconds of g++): one build for two processes, none for a third."""
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    env.pop("TESSERA_DISABLE_CPP_KERNELS", None)
    cmd = [sys.executable, "-c", LOAD_SCRIPT, str(source)]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [out for out, _ in outs] == ["42\n", "42\n"], [err for _, err in outs]
    assert sum(err.count("building C++ kernel tessera_tiny") for _, err in outs) == 1
    assert len(list((tmp_path / "ext").iterdir())) == 1
    warm = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert warm.stdout == "42\n" and "building" not in warm.stderr, warm.stderr


ZEN3 = "fpu sse2 avx avx2 fma f16c bmi1 bmi2"
SAPPHIRE = ZEN3 + " avx512f avx512bw avx512vl avx512dq avx512_vnni amx_int8"


def test_supported_isas_from_cpu_flags():
    assert build.supported_isas(SAPPHIRE, "x86_64") == ["avx512", "avx2", "portable"]
    assert build.supported_isas(ZEN3, "x86_64") == ["avx2", "portable"]
    assert build.supported_isas("fpu sse2 avx", "x86_64") == ["portable"]
    assert build.supported_isas("asimd fp sve", "aarch64") == ["portable"]


def test_cpu_isa_may_only_be_lowered(monkeypatch):
    monkeypatch.setattr(build, "_cpu_flags", lambda: ZEN3)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("TESSERA_CPU_ISA", raising=False)
    assert build.cpu_isa() == "avx2"
    monkeypatch.setenv("TESSERA_CPU_ISA", "portable")
    assert build.cpu_isa() == "portable"
    monkeypatch.setenv("TESSERA_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="TESSERA_CPU_ISA='avx512': this CPU lacks it"):
        build.cpu_isa()
    monkeypatch.setenv("TESSERA_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="TESSERA_CPU_ISA='sse9': expected one of"):
        build.cpu_isa()


def test_flags_and_key_follow_the_isa(monkeypatch):
    flags = {isa: build.cflags_for(isa) for isa in build.ISAS}
    assert "-march=native" in flags["avx512"]
    assert "-march=x86-64-v3" in flags["avx2"] and "-march=native" not in flags["avx2"]
    assert not any(f.startswith("-march") for f in flags["portable"])
    keys = {build.build_key(SOURCE, flags[isa], LDFLAGS) for isa in build.ISAS}
    assert len(keys) == 3
    # a fixed-target build does not depend on this CPU's flags: one cache for every AVX2 CPU
    avx2 = build.build_key(SOURCE, flags["avx2"], LDFLAGS)
    native = build.build_key(SOURCE, flags["avx512"], LDFLAGS)
    monkeypatch.setattr(build, "_cpu_flags", lambda: ZEN3)
    assert build.build_key(SOURCE, flags["avx2"], LDFLAGS) == avx2
    assert build.build_key(SOURCE, flags["avx512"], LDFLAGS) != native


def test_forced_isa_builds_its_own_directory(cache, tmp_path, monkeypatch):
    source = _source(tmp_path)
    build.load_extension("tessera_dummy", source)
    monkeypatch.setenv("TESSERA_CPU_ISA", "portable")
    build.load_extension("tessera_dummy", source)
    assert len(cache.calls) == 2
    assert cache.calls[0]["build_directory"] != cache.calls[1]["build_directory"]
    assert "-DTESSERA_PORTABLE=1" in cache.calls[1]["extra_cflags"]


def test_no_compiler_is_a_clear_message(cache, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    caplog.set_level(logging.WARNING, logger=build.__name__)
    assert build.load_extension("tessera_dummy", _source(tmp_path)) is None
    assert "no C++ compiler found (looked for 'no-such-compiler-xyz'" in caplog.text
    assert cache.calls == []
