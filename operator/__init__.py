"""kvpilot operator: the InferenceService CRD, reconciliation and autoscaling (kopf). torch-free."""
