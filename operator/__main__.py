"""`python -m kvpilot.operator`: run the InferenceService operator (kopf)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpilot.operator")
    ap.add_argument("--namespace", action="append", default=[], help="watch only these namespaces (repeatable); default: all")
    ap.add_argument("--prometheus-url", default=os.environ.get("KVPILOT_PROMETHEUS_URL", "http://prometheus-server.monitoring.svc:9090"),
                    help="Prometheus HTTP API base URL for autoscaling")
    ap.add_argument("--log-level", default=os.environ.get("KVPILOT_LOG_LEVEL", "info"))
    ap.add_argument("--liveness", default="0.0.0.0:8080", help="host:port serving GET /healthz and the operator's /metrics ('' to disable)")
    ap.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=True,
                    help="run handlers and autoscaler only while holding the Lease (default: on; replicas > 1 stand by)")
    ap.add_argument("--leader-election-namespace", default=os.environ.get("POD_NAMESPACE", "default"), help="namespace of the Lease")
    ap.add_argument("--lease-duration-seconds", type=float, default=15.0, help="how long a Lease is valid without renewal")
    ap.add_argument("--lease-renew-deadline-seconds", type=float, default=None, help="step down when renewal has failed this long (default: 2/3 of the duration)")
    ap.add_argument("--lease-retry-seconds", type=float, default=None, help="renew/retry period (default: 1/7 of the duration)")
    ap.add_argument("--engine-image", action="append", default=[], metavar="ENGINE=IMAGE",
                    help="the image of ENGINE's pods (kvpilot, vllm, sglang) when a spec names none (repeatable; default: the pinned "
                         "releases); kvpilot's also runs model downloads for every engine")
    ap.add_argument("--engine-image-pull-secret", action="append", default=[], metavar="NAME",
                    help="a Secret every engine pod and model cache loader pulls its images with (repeatable)")
    cache = ap.add_argument_group("model cache (defaults for what an InferenceService's spec.model.cache leaves unset)")
    cache.add_argument("--model-cache-mode", choices=["PerPod", "Shared"], default=os.environ.get("KVPILOT_MODEL_CACHE_MODE", "PerPod"),
                       help="PerPod: each pod downloads its model; Shared: one ReadWriteMany claim per source, filled once (default: PerPod)")
    cache.add_argument("--model-cache-storage-class", default=os.environ.get("KVPILOT_MODEL_CACHE_STORAGE_CLASS", ""),
                       help="StorageClass of the cache's claims (default: the cluster's default class)")
    cache.add_argument("--model-cache-size", default=os.environ.get("KVPILOT_MODEL_CACHE_SIZE", "20Gi"), help="storage of an entry's claim (default: 20Gi)")
    cache.add_argument("--compile-cache-size", default=os.environ.get("KVPILOT_COMPILE_CACHE_SIZE", "5Gi"),
                       help="storage of a namespace's compile-cache claim (default: 5Gi)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level.lower() != "debug":  # kopf logs every handler run at INFO (the autoscaler timer runs each second)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per Prometheus query, every pass
    from kvpilot.operator.builders.engines import ENGINE_IMAGES_ENV, PINNED_IMAGES, PULL_SECRETS_ENV

    for item in args.engine_image:
        engine, _, image = item.partition("=")
        if engine not in PINNED_IMAGES or not image:
            ap.error(f"--engine-image {item!r}: ENGINE=IMAGE with ENGINE one of {', '.join(PINNED_IMAGES)}")
    os.environ[ENGINE_IMAGES_ENV] = ",".join(args.engine_image)
    os.environ[PULL_SECRETS_ENV] = ",".join(args.engine_image_pull_secret)
    os.environ["KVPILOT_PROMETHEUS_URL"] = args.prometheus_url
    os.environ["KVPILOT_WATCH_NAMESPACES"] = ",".join(args.namespace)
    os.environ.update(KVPILOT_MODEL_CACHE_MODE=args.model_cache_mode, KVPILOT_MODEL_CACHE_STORAGE_CLASS=args.model_cache_storage_class,
                      KVPILOT_MODEL_CACHE_SIZE=args.model_cache_size, KVPILOT_COMPILE_CACHE_SIZE=args.compile_cache_size)

    import kopf
    from kubernetes import client

    from kvpilot.operator import controller  # noqa: F401  (registers the handlers)
    from kvpilot.operator.kube import load_config, set_identity
    from kvpilot.operator.leader import LeaderElector, default_identity

    load_config()
    identity = set_identity(default_identity())
    if args.liveness:
        serve_liveness(args.liveness)
    elector = None
    if args.leader_election:
        d = args.lease_duration_seconds
        elector = LeaderElector(client.CoordinationV1Api(), args.leader_election_namespace, identity, lease_seconds=d,
                                renew_deadline_seconds=args.lease_renew_deadline_seconds or d * 2 / 3,
                                retry_seconds=args.lease_retry_seconds or max(0.5, d / 7))
        elector.acquire()
        # Losing the lease means another replica may lead now: stop at once, without another write.
        renewing = threading.Event()
        renewal = elector.keep_leading(on_lost=lambda: os._exit(3), stop=renewing)
    try:
        scope = {"namespaces": args.namespace} if args.namespace else {"clusterwide": True}
        asyncio.run(kopf.operator(standalone=True, **scope))
    finally:
        if elector is not None:
            # The renewal must end before the hand-over: a renewal racing it would either make the release
            # fail (409) or, seeing the Lease free, take it straight back.
            renewing.set()
            renewal.join(timeout=elector.retry_seconds + 10)
            elector.release()
    return 0


def serve_liveness(address: str) -> None:
    """GET /healthz answers 200 while the process runs, leading or standing by (kopf's own endpoint
    exists only once kopf runs, i.e. only on the leader); GET /metrics, the operator's own metrics."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from kvpilot.operator.metrics import REGISTRY

    class Healthz(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            path = self.path.split("?")[0]
            body, ctype, code = (b"ok", "text/plain", 200) if path == "/healthz" else \
                (generate_latest(REGISTRY), CONTENT_TYPE_LATEST, 200) if path == "/metrics" else (b"not found", "text/plain", 404)
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # probes every few seconds: not worth a log line
            pass

    host, _, port = address.rpartition(":")
    server = ThreadingHTTPServer((host or "0.0.0.0", int(port)), Healthz)
    threading.Thread(target=server.serve_forever, name="liveness", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
