"""kvpilot-gateway: an OpenAI-compatible proxy in front of each InferenceService's engine pods that
routes by prompt prefix (so a shared system prompt keeps hitting the replica whose prefix cache
holds it) with bounded load. torch- and tokenizer-free, like KubeAI's proxy."""
