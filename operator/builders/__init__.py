"""Pure functions: InferenceService spec -> Kubernetes manifests (dicts). No API calls here."""
