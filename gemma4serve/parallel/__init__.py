"""Tensor parallelism: one process per device, each holding its shard of every layer
(docs/architecture.md, "Tensor parallelism")."""
