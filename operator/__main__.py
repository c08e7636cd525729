"""`python -m kvpilot.operator`: run the InferenceService operator (kopf)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpilot.operator")
    ap.add_argument("--namespace", action="append", default=[], help="watch only these namespaces (repeatable); default: all")
    ap.add_argument("--prometheus-url", default=os.environ.get("KVPILOT_PROMETHEUS_URL", "http://prometheus-server.monitoring.svc:9090"),
                    help="Prometheus HTTP API base URL for autoscaling")
    ap.add_argument("--peering", default=None, help="kopf peering name for HA (needs kopf's peering CRD); default: standalone")
    ap.add_argument("--log-level", default=os.environ.get("KVPILOT_LOG_LEVEL", "info"))
    ap.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint ('' to disable)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level.lower() != "debug":  # kopf logs every handler run at INFO (the autoscaler timer runs each second)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    os.environ["KVPILOT_PROMETHEUS_URL"] = args.prometheus_url
    os.environ["KVPILOT_WATCH_NAMESPACES"] = ",".join(args.namespace)

    import kopf

    from kvpilot.operator import controller  # noqa: F401  (registers the handlers)
    from kvpilot.operator.kube import load_config

    load_config()
    kwargs = dict(clusterwide=not args.namespace, namespaces=args.namespace or None,
                  standalone=args.peering is None, peering_name=args.peering, liveness_endpoint=args.liveness or None)
    asyncio.run(kopf.operator(**{k: v for k, v in kwargs.items() if v is not None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
