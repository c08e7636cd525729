"""The engine: request state, KV-block bookkeeping, scheduling policy, and the device side: one worker per rank, its drafters."""
