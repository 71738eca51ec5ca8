"""Engine configuration: frozen dataclasses, validated on construction.

`EngineArgs` is the flat set of user-facing knobs (the same names for `LLM(**kwargs)` and for
`tessera serve --flag`); `EngineArgs.create_engine_config()` turns it into the per-part configs once
the model's own limits are known. Nothing here reads files or touches tensors.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass, field

GiB = 1 << 30


class PreemptionMode(enum.Enum):
    """How a running group gives up its device blocks when the pool runs dry."""

    SWAP = "swap"  # KV goes to the CPU swap pool and comes back later
    RECOMPUTE = "recompute"  # KV is dropped; the group prefills prompt + output again


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


def flag_name(name: str) -> str:
    """The command-line flag of a config field: `max_num_seqs` -> `--max-num-seqs`. Error messages
    name flags with it, and the CLI (tessera/entrypoints/cli.py) registers them with it."""
    return "--" + name.replace("_", "-")


# vLLM's --dtype spellings; "auto" is the checkpoint's own dtype (tessera/model/checkpoint_dtype.py)
DTYPE_CHOICES = ("auto", "float32", "float", "bfloat16", "half", "float16")
# --quantization: see ModelConfig.quantization; docs/cpu_kernels.md says which runs where
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "gguf_int8")
# auto: gguf_int8 or gguf by CPU and file (tessera/model/loader.py, auto_quantization)
QUANTIZATION_DEFAULT = "auto"
RESOLVED_DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}


def resolve_dtype(dtype: str, checkpoint_dtype: str | None, device: str) -> str:
    """The compute dtype a `--dtype` value means: "auto" is the checkpoint's dtype (float32 when
    not known yet). float16 is refused on CPU, with the reason; ValueError for an unknown value."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    resolved = (
        (checkpoint_dtype or "float32") if dtype == "auto" else _DTYPE_ALIASES.get(dtype, dtype)
    )
    if resolved == "float16" and device.split(":")[0] == "cpu":
        raise ValueError(
            f"--dtype {dtype} is not supported on CPU: the CPU kernels (linear, attention, fused "
            "norms, quantized GEMV) have float32 and bfloat16 paths only, and this CPU has no fast "
            "fp16 arithmetic. Use --dtype bfloat16 (the same 2 bytes per value) or float32"
        )
    return resolved


@dataclass(frozen=True)
class ModelConfig:
    """What model to run and in which dtype. `max_model_len` is resolved against the model."""

    model: str | None = None
    dtype: str = "float32"
    max_model_len: int = 2048
    seed: int = 0
    # most alternatives per token a request may ask for (logprobs, prompt_logprobs, top_logprobs)
    max_logprobs: int = 20
    # "gguf_int8": a GGUF's weights stay in their blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
    # Q5_K, Q6_K) and run on integer dot products against activations quantized per row to Q8
    # blocks; "gguf": the same blocks with exact float products; "none": all dequantized at load;
    # "auto": gguf_int8 on the AVX2 build for mostly quantized GGUFs, else gguf (loader.py)
    quantization: str = QUANTIZATION_DEFAULT

    def __post_init__(self) -> None:
        if self.dtype not in RESOLVED_DTYPES:
            raise ValueError(f"--dtype must resolve to one of {', '.join(RESOLVED_DTYPES)}, "
                             f"got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be >= 0, got {self.max_logprobs}")


KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "float32")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype the KV cache is stored in: "auto" is the compute dtype (`model_dtype`, resolved);
    bfloat16 beside fp32 activations halves KV memory and the bytes attention reads (the kernel
    widens rows on load). ValueError naming the flag for an unknown value."""
    if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
            f"got {kv_cache_dtype!r}"
        )
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. The number of device blocks comes from `kv_cache_space` (GiB)
    unless `num_gpu_blocks_override` pins it; the CPU swap pool from `swap_space` (GiB)."""

    block_size: int = 16
    kv_cache_space: float = 1.0
    swap_space: float = 1.0
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True  # vLLM v1's default
    watermark: float = 0.01
    # --kv-cache-dtype (vLLM's CacheConfig.cache_dtype); EngineArgs resolves "auto" to the model
    # dtype, so engine code reads a concrete name (resolve_kv_cache_dtype for direct constructions)
    cache_dtype: str = "auto"
    # the window every layer of the model attends within (Mistral, all-sliding Qwen): blocks a
    # sequence's window has left are released while it runs (core/block_manager.py); None keeps
    # every block (no window, or local and global layers mixed)
    sliding_window: int | None = None
    # each model layer's window (None: full attention) when the model mixes local and global
    # layers (Gemma 2/3): the cache is split into KV cache groups with a block table each
    # (core/kv_cache_groups.py). Empty: one group, every layer in it
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        resolve_kv_cache_dtype(self.cache_dtype, "float32")  # validates the name
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.layer_windows and self.sliding_window is not None:
            raise ValueError("CacheConfig: give sliding_window (every layer) or layer_windows "
                             "(mixed layers), not both")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.kv_cache_space <= 0:
            raise ValueError(f"--kv-cache-space must be > 0 GiB, got {self.kv_cache_space}")
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0 GiB, got {self.swap_space}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"--num-gpu-blocks-override must be >= 1, got {self.num_gpu_blocks_override}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and policy. Preemption swaps by default (None means the same): measured
    1.23x the output tok/s of recompute under a tight cache (benchmarks/preemption.py), and it
    falls back to recompute when swap space is short, so it never aborts."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True  # vLLM v1's default
    preemption_mode: PreemptionMode | None = PreemptionMode.SWAP
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than "
                f"--max-model-len ({self.max_model_len}): enable chunked prefill "
                "(--enable-chunked-prefill) or raise --max-num-batched-tokens"
            )


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"

    def __post_init__(self) -> None:
        import importlib

        # validate the string without importing torch at module import time
        torch = importlib.import_module("torch")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"--device {self.device!r} is not a valid torch device: {e}") from e


def config_dict(value: dict | str, name: str, known: tuple[str, ...]) -> dict:
    """A JSON-object config (`LLM(name={...})`, or the JSON text of `--name-with-dashes`) as a
    dict with known keys only; every error names the option."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--{name.removesuffix('_config').replace('_', '-')}-config is not "
                             f"valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (JSON object), got {type(value).__name__}")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return value


SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = (
    "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
    "disable_by_batch_size",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's names): a proposer guesses up to `num_speculative_tokens`
    next tokens of a decoding request, the target model verifies them all in one forward pass, and
    the request advances by the accepted ones.

    `ngram`: prompt lookup, the last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`) matched against the request's prompt + output. `draft_model`: a smaller
    model at `model`. `disable_by_batch_size`: no proposals while a step runs at least that many
    requests (a big batch is compute-bound on CPU, so verifying drafts there only costs)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config: {key} must be an integer >= 1, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) is larger than "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        dbs = self.disable_by_batch_size
        if dbs is not None and (not isinstance(dbs, int) or isinstance(dbs, bool) or dbs < 1):
            raise ValueError(
                f"speculative_config: disable_by_batch_size must be an integer >= 1, got {dbs!r}"
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config: model (the draft model's path) is required "
                                 "for method draft_model")
        elif self.model is not None:
            raise ValueError(f"speculative_config: model is only for method draft_model, "
                             f"not {self.method}")

    @classmethod
    def from_dict(cls, value: dict | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From `LLM(speculative_config={...})` or the JSON of `--speculative-config`."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = config_dict(value, "speculative_config", _SPEC_KEYS)
        if "method" not in value:
            raise ValueError(f"speculative_config: method is required (one of "
                             f"{', '.join(SPECULATIVE_METHODS)})")
        return cls(**value)

    def is_enabled_for(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` requests speculates at all (the one home of the rule)."""
        return self.disable_by_batch_size is None or batch_size < self.disable_by_batch_size


KV_CONNECTORS = ("TcpConnector", "NixlConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_KV_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "kv_connector_extra_config")
_KV_EXTRA_KEYS = ("transfer_timeout", "hold_timeout")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill/decode (vLLM's names): a `kv_producer` prefills and serves each
    finished request's KV blocks on `kv_ip:kv_port`; a `kv_consumer` pulls them from the address
    the producer's response named (`kv_transfer_params`), so it needs no address of its own;
    `kv_both` does either per request. `kv_connector_extra_config`: `transfer_timeout` (seconds a
    consumer waits for one pull before it prefills locally) and `hold_timeout` (seconds a
    producer keeps a finished request's blocks for a peer that never comes)."""

    kv_connector: str = "TcpConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector must be one of "
                             f"{', '.join(KV_CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {self.kv_role!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config: kv_ip must be a host name or address, "
                             f"got {self.kv_ip!r}")
        port = self.kv_port
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"kv_transfer_config: kv_port must be an integer in [0, 65535], "
                             f"got {port!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object")
        unknown = sorted(set(extra) - set(_KV_EXTRA_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config: unknown key(s) "
                             f"{', '.join(unknown)}; known: {', '.join(_KV_EXTRA_KEYS)}")
        for key in _KV_EXTRA_KEYS:
            value = extra.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not value > 0):
                raise ValueError(f"kv_transfer_config: kv_connector_extra_config.{key} must be a "
                                 f"number of seconds > 0, got {value!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def transfer_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("transfer_timeout", 30.0))

    @property
    def hold_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("hold_timeout", 120.0))

    @classmethod
    def from_dict(cls, value: dict | str | KVTransferConfig | None) -> KVTransferConfig | None:
        """From `LLM(kv_transfer_config={...})` or the JSON of `--kv-transfer-config`."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = config_dict(value, "kv_transfer_config", _KV_KEYS)
        for key in ("kv_connector", "kv_role"):
            if key not in value:
                raise ValueError(f"kv_transfer_config: {key} is required")
        return cls(**value)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (vLLM's names): the model and its KV cache split over
    `tensor_parallel_size` worker processes, one per rank, joined by torch.distributed (gloo on
    CPU, NCCL on CUDA). Across machines: `nnodes` launches of the same command, `node_rank` 0 the
    one with the engine and the server, all meeting at `distributed_init_method`
    (tcp://HOST:PORT; default: MASTER_ADDR/MASTER_PORT when set, else a free loopback port)."""

    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    # a mixture of experts' experts placed whole on the ranks instead of each sliced over them
    # (tessera/distributed/sharding.py); nothing to place with one rank or a dense model
    enable_expert_parallel: bool = False
    # threads of this node's compute (torch and the C++ kernels), shared by its ranks; None: every
    # core the process may run on (os.sched_getaffinity: a taskset or cgroup is respected)
    num_threads: int | None = None

    def __post_init__(self) -> None:
        n = self.num_threads
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"--num-threads must be an integer >= 1, got {n!r}")
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"--tensor-parallel-size must be an integer >= 1, got {tp!r}")
        if nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
        if tp % nnodes:
            raise ValueError(f"--tensor-parallel-size ({tp}) must be a multiple of --nnodes "
                             f"({nnodes}): every node runs the same number of ranks")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes) = [0, {nnodes}), got "
                             f"{self.node_rank}")
        method = self.distributed_init_method
        if method is not None and not method.startswith(("tcp://", "env://", "file://")):
            raise ValueError(f"--distributed-init-method must be tcp://HOST:PORT, env:// or "
                             f"file://PATH, got {method!r}")
        if nnodes > 1 and method is None and not os.environ.get("MASTER_ADDR"):
            raise ValueError("--nnodes > 1 needs --distributed-init-method tcp://HOST:PORT (or "
                             "MASTER_ADDR/MASTER_PORT in the environment), the same on every node")

    @property
    def threads_per_node(self) -> int:
        """--num-threads, else the cores this process may run on."""
        return self.num_threads if self.num_threads is not None else default_num_threads()

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this launch runs (node 0 holds rank 0, the one that samples)."""
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)


POOLING_TYPES = ("LAST", "MEAN", "CLS")
_POOLER_KEYS = ("pooling_type", "normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """How `/v1/embeddings` and `LLM.embed` turn a prompt's final (normed) hidden states into one
    vector (vLLM's names and defaults for a decoder LM): LAST takes the last token's state (the
    only one that has seen the whole prompt under causal attention), MEAN averages every
    position, CLS takes the first; `normalize` scales the result to unit L2 norm."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config: normalize must be true or false, "
                             f"got {self.normalize!r}")

    @classmethod
    def from_dict(cls, value: dict | str | PoolerConfig | None) -> PoolerConfig:
        """From `LLM(pooler_config={...})` or the JSON of `--pooler-config`; None: the defaults."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        value = config_dict(value, "pooler_config", _POOLER_KEYS)
        if isinstance(value.get("pooling_type"), str):  # vLLM spells them in capitals
            value = {**value, "pooling_type": value["pooling_type"].upper()}
        return cls(**value)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names; on with --enable-lora): at most `max_loras` distinct
    adapters in one step (the scheduler's limit), ranks up to `max_lora_rank`, and up to
    `max_cpu_loras` adapters kept loaded in the CPU cache (LRU; default: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag_name(name)} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"--max-cpu-loras ({cpu}) must be an integer >= --max-loras "
                             f"({self.max_loras}): every adapter of a step is loaded")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig | None = None
    pooler: PoolerConfig = field(default_factory=PoolerConfig)
    lora: LoRAConfig | None = None  # None: --enable-lora is off

    def __post_init__(self) -> None:
        # tensor-parallel ranks build their runners without a draft model: refuse rather than
        # run the target alone under a config that asked for drafts
        if (self.parallel.tensor_parallel_size > 1 and self.speculative is not None
                and self.speculative.method == "draft_model"):
            raise ValueError("speculative_config: method draft_model does not run with "
                             f"--tensor-parallel-size {self.parallel.tensor_parallel_size} "
                             "(ngram does)")
        if self.lora is not None and self.kv_transfer is not None:
            # a request whose KV a peer computed joins the running batch outside admission,
            # where the --max-loras limit is kept
            raise ValueError("--enable-lora does not run with --kv-transfer-config yet")
        if self.parallel.tensor_parallel_size > 1 and self.kv_transfer is not None:
            # the connector's worker half lives beside one runner; ranks would each hold a shard
            raise ValueError("kv_transfer_config does not run with --tensor-parallel-size "
                             f"{self.parallel.tensor_parallel_size} yet: disaggregate TP=1 engines")


# --max-num-batched-tokens under chunked prefill when not given: vLLM v1's OpenAI server default
DEFAULT_CHUNKED_PREFILL_BUDGET = 2048


def _arg(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineArgs:
    """Every engine flag, by the name users type. Field metadata carries the `--help` text, so the
    CLI is generated from this class and nothing is listed twice."""

    model: str | None = _arg(
        None,
        "GGUF file or HF directory (config.json + *.safetensors); default: SmolLM2-135M-Instruct",
    )
    dtype: str = _arg(
        "auto",
        "compute dtype; auto: the checkpoint's (config.json torch_dtype: a bf16 checkpoint runs in "
        "bf16, fp16 in fp32; a GGUF in float32 unless its weights are BF16); half/float16 is "
        "refused on CPU",
        choices=list(DTYPE_CHOICES),
    )
    quantization: str = _arg(
        QUANTIZATION_DEFAULT,
        "auto (default): gguf_int8 on CPUs without AVX-512 for GGUFs whose matrices are mostly "
        "quantized, where its kernels are the faster ones, else gguf; gguf: keep a GGUF's "
        "quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and run exact float "
        "products on them; gguf_int8: the same blocks against activations quantized per row to "
        "8-bit blocks, integer dot products (llama.cpp's form); none: dequantize all at load",
        choices=list(QUANTIZATION_CHOICES),
    )
    device: str = _arg("cpu", "torch device, e.g. cpu or cuda:0")
    num_threads: int | None = _arg(
        None,
        "CPU threads for the model's compute (torch and the C++ kernels), split evenly between "
        "this node's tensor-parallel ranks; default: every core this process may run on "
        "(os.sched_getaffinity, so taskset and cgroup limits are respected)",
    )
    seed: int = _arg(0, "seed for sampling requests that do not give their own")
    max_model_len: int | None = _arg(
        None, "longest prompt + output in tokens (default: the model's own limit, "
              "max_position_embeddings or the GGUF's context_length)"
    )
    block_size: int = _arg(16, "tokens per KV cache block")
    max_num_batched_tokens: int | None = _arg(
        None, "token budget of one engine step (default: 2048 with chunked prefill, as vLLM v1's "
              "server; without it max(max_model_len, 2048), so a whole prompt fits)"
    )
    max_num_seqs: int = _arg(256, "most sequences running at once")
    num_gpu_blocks_override: int | None = _arg(
        None, "number of device KV blocks, ignoring --kv-cache-space"
    )
    kv_cache_space: float = _arg(1.0, "device KV cache size in GiB")
    swap_space: float = _arg(1.0, "CPU swap space for preempted KV, in GiB")
    kv_cache_dtype: str = _arg(
        "auto",
        "dtype the KV cache is stored in; auto: the compute dtype (--dtype). bfloat16 with float32 "
        "compute halves KV memory and attention's memory traffic",
        choices=list(KV_CACHE_DTYPE_CHOICES),
    )
    preemption_mode: str | None = _arg(
        "swap",
        "how to preempt when blocks run out: swap to CPU memory (falling back to recompute when "
        "--swap-space is full), or drop the KV and recompute it",
        choices=["swap", "recompute"],
    )
    # on by default, as in vLLM v1 (measured: benchmarks/scheduling_defaults.py)
    enable_chunked_prefill: bool = _arg(
        True, "split long prompts to fill each step's token budget, decodes first "
              "(--no-enable-chunked-prefill: a prompt is prefilled whole)")
    enable_prefix_caching: bool = _arg(
        True, "reuse KV blocks of shared prompt prefixes (--no-enable-prefix-caching: off)")
    disable_hybrid_kv_cache_manager: bool = _arg(
        False, "for a model mixing sliding-window and full layers (Gemma 2/3), give every layer "
               "a full-length block table instead of one table per KV cache group, whose window "
               "groups free the blocks their window has left")
    scheduling_policy: str = _arg("fcfs", "request order", choices=["fcfs", "priority"])
    speculative_config: dict | str | None = _arg(
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 16}',
        json=True,
    )
    kv_transfer_config: dict | str | None = _arg(
        None,
        'disaggregated prefill/decode, as JSON: {"kv_connector": "TcpConnector", "kv_role": '
        '"kv_producer", "kv_ip": "127.0.0.1", "kv_port": 14579}',
        json=True,
    )
    pooler_config: dict | str | None = _arg(
        None,
        'how embeddings pool the final hidden states, as JSON: {"pooling_type": "LAST" | "MEAN" '
        '| "CLS", "normalize": true} (default: LAST, normalized)',
        json=True,
    )
    max_logprobs: int = _arg(
        20, "most log-probability alternatives per token a request may ask for (logprobs, "
            "prompt_logprobs, top_logprobs)"
    )
    tensor_parallel_size: int = _arg(
        1, "split the model and KV cache over this many worker processes (torch.distributed: "
           "gloo on CPU, NCCL on CUDA)", aliases=["-tp"],
    )
    distributed_init_method: str | None = _arg(
        None, "where the ranks meet: tcp://HOST:PORT, the same on every node (default: "
              "MASTER_ADDR/MASTER_PORT if set, else a free loopback port)"
    )
    nnodes: int = _arg(1, "machines the tensor-parallel ranks span")
    node_rank: int = _arg(
        0, "this machine's index among --nnodes; 0 runs the engine and server, the others run "
           "only worker ranks"
    )
    enable_expert_parallel: bool = _arg(
        False, "mixture-of-experts models under --tensor-parallel-size N: place whole experts "
               "on the ranks (about E/N each) instead of slicing every expert N ways (no "
               "effect with one rank or on a dense model)"
    )
    enable_lora: bool = _arg(False, "serve LoRA adapters (PEFT format) over the base model")
    max_loras: int = _arg(1, "most distinct LoRA adapters in one step (with --enable-lora)")
    max_lora_rank: int = _arg(16, "largest LoRA rank r served (with --enable-lora)")
    max_cpu_loras: int | None = _arg(
        None, "LoRA adapters kept loaded in the CPU cache, LRU (default: --max-loras)"
    )

    def create_engine_config(
        self, model_max_len: int | None = None, checkpoint_dtype: str | None = None,
        sliding_window: int | None = None, layer_windows: tuple[int | None, ...] = (),
    ) -> EngineConfig:
        """Resolve defaults against the model's context limit and stored dtype (what `--dtype
        auto` runs; float32 when not given) and validate the combination. `sliding_window`: the
        model's window when every layer has one (`ModelArchConfig.uniform_window`);
        `layer_windows`: each layer's (`ModelArchConfig.layer_windows`), which, when they differ,
        split the cache into KV cache groups (core/kv_cache_groups.py)."""
        if self.max_model_len is None:  # the model's own limit, as in vLLM
            max_model_len = model_max_len or 2048
        else:
            max_model_len = self.max_model_len
            if model_max_len is not None and max_model_len > model_max_len:
                raise ValueError(
                    f"--max-model-len ({max_model_len}) exceeds the model's limit ({model_max_len})"
                )
        if self.max_num_batched_tokens is not None:
            budget = self.max_num_batched_tokens
        elif self.enable_chunked_prefill:
            budget = DEFAULT_CHUNKED_PREFILL_BUDGET
        else:
            budget = max(max_model_len, 2048)
        for name, enum_cls in (
            ("preemption_mode", PreemptionMode),
            ("scheduling_policy", SchedulingPolicy),
        ):
            value = getattr(self, name)
            if value is not None and value not in {m.value for m in enum_cls}:
                choices = ", ".join(m.value for m in enum_cls)
                raise ValueError(f"{flag_name(name)} must be one of {choices}, got {value!r}")
        speculative = SpeculativeConfig.from_dict(self.speculative_config)
        kv_transfer = KVTransferConfig.from_dict(self.kv_transfer_config)
        pooler = PoolerConfig.from_dict(self.pooler_config)
        dtype = resolve_dtype(self.dtype, checkpoint_dtype, self.device)
        hybrid = len(set(layer_windows)) > 1 and not self.disable_hybrid_kv_cache_manager
        draft = speculative is not None and speculative.method == "draft_model"
        if kv_transfer is not None and draft:
            # a KV connector moves the target's groups of one table; a draft model would add
            # a group of its own to it (core/block_manager.py): keep one full table instead
            sliding_window = None
            hybrid = False
        return EngineConfig(
            model=ModelConfig(
                model=self.model,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=self.seed,
                max_logprobs=self.max_logprobs,
                quantization=self.quantization,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_space=self.kv_cache_space,
                swap_space=self.swap_space,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, dtype),
                sliding_window=sliding_window,
                layer_windows=tuple(layer_windows) if hybrid else (),
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=budget,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                preemption_mode=PreemptionMode(self.preemption_mode)
                if self.preemption_mode
                else None,
                scheduling_policy=SchedulingPolicy(self.scheduling_policy),
            ),
            device=DeviceConfig(device=self.device),
            speculative=speculative,
            parallel=self.parallel_config(),
            kv_transfer=kv_transfer,
            pooler=pooler,
            lora=self.lora_config(),
        )

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
        )

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_init_method=self.distributed_init_method,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            num_threads=self.num_threads,
            enable_expert_parallel=self.enable_expert_parallel,
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def default_num_threads() -> int:
    """The cores this process may run on (its affinity mask, not the machine's core count)."""
    return max(1, len(os.sched_getaffinity(0)))
