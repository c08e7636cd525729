"""Model architectures (the Llama family for now)."""
