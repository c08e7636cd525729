"""Model code: one decoder for the supported families (models/config.py lists them)."""
