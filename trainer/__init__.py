"""The GRPO trainer: advantages, losses, batching, backends, weight sync, checkpoints.

Not built yet; it consumes :class:`agentenv.Sample` batches from the Data Buffer.
"""
