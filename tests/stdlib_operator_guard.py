"""Proves `import operator` still means the stdlib module after everything kvpilot imported."""

import operator
import sys
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def check() -> None:
    mod = sys.modules["operator"]
    assert mod is operator, "sys.modules['operator'] was replaced"
    origin = getattr(mod, "__file__", None)
    assert origin is not None and Path(origin).resolve().is_relative_to(STDLIB), f"operator comes from {origin}"
    assert hasattr(mod, "itemgetter")
