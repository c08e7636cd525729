"""What every pod the operator makes shares: the non-root user and locked-down security contexts of the
kvpilot images, and the writable cache directory (the root filesystem is read-only)."""

CACHE_DIR = "/cache"           # emptyDir: kernel and Triton caches, HOME (the root filesystem is read-only)
RUN_AS = 65532                 # the engine image's user (Dockerfile.engine)
POD_SECURITY_CONTEXT = {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                        "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_CONTEXT = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                              "capabilities": {"drop": ["ALL"]}}
CACHE_ENV = [{"name": "HOME", "value": CACHE_DIR}, {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
             {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"}]
