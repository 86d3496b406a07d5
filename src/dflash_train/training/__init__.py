"""The train job's training loop: optimizer, schedule, data parallelism, metrics, checkpoints."""
