"""The end of a process that cannot go on: its cause logged, printed and left where Kubernetes shows it
(the container's termination message), then an exit that does not wait for threads or collectives."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

# Kubernetes mounts the container's terminationMessagePath here; its content becomes the
# container's last-state message (what `kubectl describe` and the operator show).
TERMINATION_LOG = Path(os.environ.get("KVPILOT_TERMINATION_LOG", "/dev/termination-log"))


def write_termination_message(message: str) -> None:
    """The fatal error for Kubernetes' termination message, where the kubelet provides the file."""
    if TERMINATION_LOG.is_file():
        try:
            TERMINATION_LOG.write_text(message[-4000:])
        except OSError:
            pass


def fatal(message: str) -> None:
    """Log, leave the message for the pod status, and exit now (threads and collectives included)."""
    log.critical(message)
    print(f"kvpilot: fatal: {message}", file=sys.stderr, flush=True)
    write_termination_message(message)
    os._exit(70)
