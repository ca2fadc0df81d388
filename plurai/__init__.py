"""Plurai: queue-driven LLM inference. The client, importable from the top:

    from plurai import Client
    with Client("redis://localhost:6379/0") as client:
        print(client.submit("Hello", max_tokens=16).result(timeout=60).text)

Installed, the repository's packages live under this one name (plurai.producer, the client
SDK; plurai.gpu_workers, the workers; ...): pyproject's package-dir maps each to its folder
at the repository's top level, and this folder holds only this file. Its names are
producer's, imported on first use, so that a worker or a vLLM process that imports
plurai.gpu_workers does not load the client.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

# Started from a checkout (a container's /app, a clone), this folder comes first on
# sys.path and holds none of the packages: look for them in the installed plurai too.
__path__ = pkgutil.extend_path(__path__, __name__)

__all__ = ["AsyncClient", "AsyncJob", "Client", "Job", "JobCancelled", "JobFailed"]
__all__ += ["JobRestarted", "QueueFull", "RedisFull"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("plurai.producer"), name)
    raise AttributeError(f"module 'plurai' has no attribute {name!r}")
