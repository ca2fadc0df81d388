"""Plurai: queue-driven LLM inference. The client, importable from the top:

    from plurai import Client
    with Client("redis://localhost:6379/0") as client:
        print(client.submit("Hello", max_tokens=16).result(timeout=60).text)

Installed, the repository's packages live under this one name (plurai.producer, the client
SDK; plurai.gpu_workers, the workers; ...): pyproject's package-dir maps each to its folder
at the repository's top level, and this folder holds only the client's names, producer's.
"""

from plurai.producer import *  # noqa: F403
from plurai.producer import __all__  # noqa: F401
