"""`EngineArgs`: the flat set of user-facing knobs, the same names for `LLM(**kwargs)` and for
`tessera serve --flag`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tessera.config.cache import KV_CACHE_DTYPE_CHOICES, CacheConfig, resolve_kv_cache_dtype
from tessera.config.common import flag_name
from tessera.config.engine import EngineConfig
from tessera.config.kv_transfer import KVTransferConfig
from tessera.config.lora import LoRAConfig
from tessera.config.model import (
    DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    QUANTIZATION_DEFAULT,
    DeviceConfig,
    ModelConfig,
    resolve_dtype,
)
from tessera.config.parallel import ParallelConfig
from tessera.config.pooler import PoolerConfig
from tessera.config.scheduler import PreemptionMode, SchedulerConfig, SchedulingPolicy
from tessera.config.speculative import SpeculativeConfig

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
        "auto (default): for GGUFs whose matrices are mostly quantized, gguf_int8_a16 on x86 "
        "CPUs (its kernels are the faster ones there), but gguf in bfloat16 on AVX-512 ones "
        "(AMX bf16 tiles), else gguf; gguf: keep a GGUF's quantized weights (Q4_0, Q4_1, Q5_0, "
        "Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and run exact float products on them; gguf_int8: the "
        "same blocks against activations quantized per row to 8-bit blocks, integer dot "
        "products (llama.cpp's form); gguf_int8_a16: the same with a second 8-bit plane of the "
        "activations' rounding residuals (16 bits: the float model's greedy tokens); none: "
        "dequantize all at load",
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
