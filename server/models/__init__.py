"""Model code: one decoder for the supported families (model_config.py lists them)."""
