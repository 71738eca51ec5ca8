"""Engines that work together across processes or machines. Tensor parallelism: how a model is
cut over ranks (`sharding`), the collectives a sharded forward pass needs (`group`), and the
channel that carries each step to every rank (`channel`). Disaggregated prefill/decode: KV
transfer between a prefill and a decode engine (`kv_transfer/`)."""
