"""Assemble an engine from `EngineArgs`: resolve and load the model, size the KV pools, build the
runner. Kept apart from `LLMEngine` so the engine itself can be built from parts in tests."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
import uuid
from dataclasses import dataclass

import torch

from tessera.config import EngineArgs
from tessera.core.admission import draft_pool_blocks
from tessera.engine.malloc_tuning import release_free_memory
from tessera.engine.sizing import describe_config, size_kv_pools
from tessera.executor.uniproc_executor import UniProcExecutor
from tessera.model.checkpoint_dtype import checkpoint_dtype
from tessera.model.config import ModelArchConfig
from tessera.model.default_model import resolve_model_path
from tessera.model.loader import load_model, weight_quantization
from tessera.model.registry import get_model_class
from tessera.sampling.grammar import GrammarBackend
from tessera.tokenizer import load_tokenizer
from tessera.worker.cache_engine import CacheEngine, kv_cache_spec
from tessera.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class ModelBundle:
    """A loaded model and its tokenizer: what several engines (different cache or scheduler
    settings, same weights and dtype) can share."""

    path: str
    arch: ModelArchConfig
    model: object
    tokenizer: object
    dtype: str
    device: str
    max_positions: int
    quantization: str = "gguf"
    checkpoint_dtype: str | None = None  # what `--dtype auto` resolves to for this model


def load_bundle(args: EngineArgs) -> ModelBundle:
    # fail on bad flags before spending seconds on the weights; checks that need the model's own
    # context limit (an unset --max-model-len) wait for it
    path = resolve_model_path(args.model)
    stored_dtype = checkpoint_dtype(path)
    early = dataclasses.replace(args, max_model_len=args.max_model_len or 1).create_engine_config(
        None, stored_dtype)
    torch.set_num_threads(early.parallel.threads_per_node)  # --num-threads; packing uses them too
    arch, weights = load_model(path, weight_quantization(
        early.model.quantization, early.model.dtype, early.device.device, path))
    config = args.create_engine_config(
        arch.max_position_embeddings, stored_dtype, arch.uniform_window, arch.layer_windows
    )
    device = torch.device(config.device.device)
    model_cls = get_model_class(arch.architecture)
    model = model_cls(
        arch, weights, getattr(torch, config.model.dtype), device, config.model.max_model_len
    )
    del weights  # the model holds its own (packed) copies; the file's blocks go now
    release_free_memory()  # and their pages, which the heap would otherwise keep resident
    return ModelBundle(
        path,
        arch,
        model,
        load_tokenizer(path, arch.architecture),
        config.model.dtype,
        config.device.device,
        config.model.max_model_len,
        config.model.quantization,
        stored_dtype,
    )


def build_engine(engine_cls, args: EngineArgs, bundle: ModelBundle | None = None):
    """Load the model (unless a compatible `bundle` is given), size the KV pools, build the
    engine."""
    if args.tensor_parallel_size > 1 or args.nnodes > 1:
        if bundle is not None:
            raise ValueError(
                "a loaded model bundle cannot be shared with --tensor-parallel-size "
                "> 1: each rank loads its own shard"
            )
        from tessera.engine.tp_loading import build_tp_engine

        return build_tp_engine(engine_cls, args)
    start = time.perf_counter()
    bundle = bundle or load_bundle(args)
    arch, path = bundle.arch, bundle.path
    config = args.create_engine_config(
        arch.max_position_embeddings, bundle.checkpoint_dtype, arch.uniform_window,
        arch.layer_windows,
    )
    if config.parallel.enable_expert_parallel:  # accepted, as vLLM does; nothing to place
        logger.info("--enable-expert-parallel with one rank: every expert is on it")
    loaded = (bundle.dtype, bundle.device, bundle.quantization)
    if (config.model.dtype, config.device.device, config.model.quantization) != loaded or (
        config.model.max_model_len > bundle.max_positions
    ):
        raise ValueError(
            "the model bundle was loaded with another dtype, device, quantization or max_model_len"
        )
    torch.manual_seed(config.model.seed)
    device = torch.device(config.device.device)
    model, tokenizer = bundle.model, bundle.tokenizer

    spec = kv_cache_spec(arch, config, arch.num_key_value_heads)
    num_gpu_blocks, num_cpu_blocks = size_kv_pools(config, spec)
    cache_engine = CacheEngine(spec, num_gpu_blocks, num_cpu_blocks, device)
    eos = tuple(arch.eos_token_ids)
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    # one compile cache for both sides: the engine validates a constraint, the runner applies it
    grammar_backend = GrammarBackend(tokenizer, arch.vocab_size, eos)
    draft = None
    if config.speculative is not None and config.speculative.method == "draft_model":
        from tessera.engine.draft_loading import build_draft_proposer

        draft = build_draft_proposer(
            config, path, model, arch, tokenizer, num_gpu_blocks, num_cpu_blocks,
            num_draft_gpu_blocks=draft_pool_blocks(config, num_gpu_blocks),
        )
    kv_worker, kv_scheduler = _kv_connector(config, cache_engine)
    runner = ModelRunner(
        model,
        cache_engine,
        config.cache.block_size,
        device,
        eos_token_ids=eos,
        speculative_config=config.speculative,
        grammar_backend=grammar_backend,
        draft_proposer=draft,
        kv_connector=kv_worker,
        lora_config=config.lora,
    )
    logger.info("resolved engine configuration: model=%s, %s", path, describe_config(config))
    logger.info(
        "engine ready in %.1fs: %s, %s, %d device blocks (%d tokens of every layer%s), %d "
        "swap blocks",
        time.perf_counter() - start,
        os.path.basename(path),
        config.model.dtype,
        num_gpu_blocks,
        num_gpu_blocks // spec.num_groups * config.cache.block_size,
        f"; {spec.num_groups} KV cache groups of {spec.num_slots} layers"
        if spec.num_groups > 1 else "",
        num_cpu_blocks,
    )
    # long-lived objects out of the cyclic GC's way: full collections otherwise walk every
    # waiting request each time and make step cost grow with the queue (benchmarks/scheduler.py)
    gc.collect()
    gc.freeze()
    return engine_cls(
        config,
        UniProcExecutor(runner),
        tokenizer,
        eos_token_ids=eos,
        vocab_size=arch.vocab_size,
        model_name=os.path.basename(path.rstrip("/")),
        grammar_backend=grammar_backend,
        kv_connector=kv_scheduler,
        model_arch=arch,
    )


def _kv_connector(config, cache_engine: CacheEngine):
    """Both halves of the configured KV connector (None, None without --kv-transfer-config):
    the worker half binds its port first, and the scheduler half advertises that port."""
    kv = config.kv_transfer
    if kv is None:
        return None, None
    from tessera.core.kv_cache_groups import cache_group_windows
    from tessera.core.kv_connector import PullConnectorScheduler
    from tessera.distributed.kv_transfer import create_kv_connector_worker

    engine_id = uuid.uuid4().hex
    worker = create_kv_connector_worker(kv, cache_engine, engine_id)
    if kv.is_producer:
        kv = dataclasses.replace(kv, kv_port=worker.port)
    num_groups = len(cache_group_windows(config.cache.sliding_window, config.cache.layer_windows))
    return worker, PullConnectorScheduler(kv, config.cache.block_size, engine_id=engine_id,
                                          num_groups=num_groups)
