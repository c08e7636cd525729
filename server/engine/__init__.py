"""The engine: request state, KV-block bookkeeping, scheduling policy, and the device-side runner."""
