"""llama.cpp for the benchmarks: built once from the llama-cpp-python 0.3.36 sdist's vendored
llama.cpp (pip download, CMake, targets llama-bench and llama-server, ~10 min on two cores),
cached outside the repository (default ~/.cache/tessera/llama.cpp), and llama-bench run on a GGUF.

A native build (GGML_NATIVE=ON) and, for comparisons with Tessera's avx2 path on a CPU that has
more, a build for AVX2 only (`AVX2_FLAGS`). benchmarks/llamacpp_peer.py compares against them;
int8_agreement.py, gemma3.py and moe.py use the binaries too.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tarfile

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
DEFAULT_BUILD_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tessera", "llama.cpp")
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
# The peer of Tessera's avx2 build on a CPU that has more (`--peer-isa matched`): llama.cpp
# built for what an AVX2 CPU such as Zen 3 has, and nothing past it, so that both engines run
# the same instruction set; the native build would run AVX-512 (and VNNI) kernels there.
AVX2_FLAGS = [
    "-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
    "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF",
    "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
]
PEER_BUILDS = {"native": ("build", []), "avx2": ("build-avx2", AVX2_FLAGS)}


def llama_bench_path(build_dir: str, peer: str = "native") -> str:
    """llama-bench under `build_dir`: our cache's layout (build/bin, build-avx2/bin), or, for the
    native build, a CMake build dir itself."""
    own = os.path.join(build_dir, "bin", "llama-bench")
    if peer == "native" and os.path.exists(own):
        return own
    return os.path.join(build_dir, PEER_BUILDS[peer][0], "bin", "llama-bench")


def build_llama_cpp(build_dir: str = DEFAULT_BUILD_DIR, peer: str = "native") -> str:
    """llama-bench (and llama-server) of the sdist's vendored llama.cpp, built once into
    `build_dir` (`peer`: "native", or "avx2" for AVX2_FLAGS); returns llama-bench's path."""
    bench = llama_bench_path(build_dir, peer)
    if os.path.exists(bench):
        return bench
    os.makedirs(build_dir, exist_ok=True)
    sdists = glob.glob(os.path.join(build_dir, "llama_cpp_python-*.tar.gz"))
    if not sdists:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                LLAMA_CPP_PYTHON,
                "-d",
                build_dir,
            ],
            check=True,
        )
        sdists = glob.glob(os.path.join(build_dir, "llama_cpp_python-*.tar.gz"))
    src_root = os.path.join(build_dir, "src")
    if not os.path.isdir(src_root):
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(src_root, filter="data")
    (top,) = os.listdir(src_root)
    source = os.path.join(src_root, top, "vendor", "llama.cpp")
    subdir, flags = PEER_BUILDS[peer]
    out = os.path.join(build_dir, subdir)
    subprocess.run(["cmake", "-S", source, "-B", out, *CMAKE_FLAGS, *flags], check=True)
    subprocess.run(
        ["cmake", "--build", out, "--target", "llama-bench", "llama-server", "-j2"], check=True
    )
    return bench


def llama_bench(bench: str, model: str, threads: int) -> dict[str, float]:
    """{"prefill": pp512 tok/s, "decode": tg128 tok/s, "repack": 1 or 0} from one llama-bench
    run. Its weight repacking is on by default; where that dies of SIGILL (seen under KVM on a
    Sapphire Rapids guest with AMX: the AMX repacked matmul), the run is repeated with
    `--repack 0` and the result says so."""
    cmd = [
        bench,
        "-m",
        model,
        "-p",
        "512",
        "-n",
        "128",
        "-t",
        str(threads),
        "-r",
        "2",
        "-o",
        "json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    out: dict[str, float] = {"repack": 1}
    if done.returncode != 0:
        print(f"llama-bench failed (rc {done.returncode}); again with --repack 0", flush=True)
        done = subprocess.run([*cmd, "--repack", "0"], capture_output=True, text=True, check=True)
        out["repack"] = 0
    for row in json.loads(done.stdout):
        key = "prefill" if row["n_prompt"] == 512 else "decode"
        out[key] = float(row["avg_ts"])
    return out
