"""Tensor parallelism: how a model is cut over ranks (`sharding`), the collectives a sharded
forward pass needs (`group`), and the channel that carries each step to every rank (`channel`)."""
