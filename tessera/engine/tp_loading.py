"""Assemble a tensor-parallel engine: the driver reads only the model's shapes and its tokenizer;
the worker processes (tessera/executor/multiproc_executor.py) load the weights, each its shard.

A configuration that cannot shard (heads not divisible by the size) is refused here, from the
shapes, before any process starts or any weight is read.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time

from tessera.config import EngineArgs
from tessera.distributed.sharding import ShardPlan
from tessera.engine.sizing import describe_config, size_kv_pools
from tessera.executor.multiproc_executor import MultiprocExecutor
from tessera.model.default_model import resolve_model_path
from tessera.model.loader import read_model_config
from tessera.sampling.grammar import GrammarBackend
from tessera.tokenizer import load_tokenizer
from tessera.worker.cache_engine import kv_cache_spec
from tessera.worker.tp_worker import WorkerInit

logger = logging.getLogger(__name__)


def build_tp_engine(engine_cls, args: EngineArgs):
    start = time.perf_counter()
    early = dataclasses.replace(args, max_model_len=args.max_model_len or 1).create_engine_config()
    parallel = early.parallel
    if parallel.node_rank != 0:
        raise ValueError(f"--node-rank {parallel.node_rank} runs worker ranks only (tessera serve "
                         "starts them); the engine runs on node 0")
    path = resolve_model_path(args.model)
    arch = read_model_config(path)
    n = parallel.tensor_parallel_size
    # refuses a size that does not shard, naming the numbers (the workers build the same plans)
    plan = ShardPlan.for_arch(arch, 0, n, parallel.enable_expert_parallel)
    if parallel.enable_expert_parallel and not plan.expert_parallel:
        logger.info("--enable-expert-parallel: %s is dense, no experts to place",
                    arch.architecture)
    config = args.create_engine_config(arch.max_position_embeddings, None, arch.uniform_window,
                                       arch.layer_windows)
    # --kv-cache-space and --swap-space are per rank, as vLLM's memory fraction is per device
    spec = kv_cache_spec(arch, config, plan.num_local_kv_heads)
    num_gpu_blocks, num_cpu_blocks = size_kv_pools(config, spec)
    tokenizer = load_tokenizer(path, arch.architecture)
    eos = tuple(arch.eos_token_ids)
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    init = WorkerInit(engine_args=args, model_path=path, num_gpu_blocks=num_gpu_blocks,
                      num_cpu_blocks=num_cpu_blocks, eos_token_ids=eos)
    executor = MultiprocExecutor(parallel, init, config.device.device)
    logger.info("resolved engine configuration: model=%s, %s", path, describe_config(config))
    experts = (f", experts placed whole ({len(plan.expert_ids)} on rank 0 of {arch.num_experts})"
               if plan.expert_parallel else "")
    logger.info("engine ready in %.1fs: %s, %s, tensor-parallel size %d (%s KV heads per rank%s), "
                "%d device blocks per rank, %d swap blocks", time.perf_counter() - start,
                os.path.basename(path), config.model.dtype, n,
                plan.num_local_kv_heads, experts, num_gpu_blocks, num_cpu_blocks)
    gc.collect()
    gc.freeze()
    return engine_cls(
        config, executor, tokenizer, eos_token_ids=eos, vocab_size=arch.vocab_size,
        model_name=os.path.basename(path.rstrip("/")),
        grammar_backend=GrammarBackend(tokenizer, arch.vocab_size, eos),
        model_arch=arch,
    )
