"""Autoscaling on engine KV-cache utilization and queue depth: metric queries, the decision rule, the loop."""
