"""Plurai: queue-driven LLM inference. The client, importable from the top:

    from plurai import Client
    with Client("redis://localhost:6379/0") as client:
        print(client.submit("Hello", max_tokens=16).result(timeout=60).text)

Installed, the repository's packages live under this one name (plurai.producer, the client
SDK; plurai.gpu_workers, the workers; ...): pyproject's package-dir maps each to its folder
at the repository's top level, and this folder holds only the names below.
"""

from plurai.producer import (
    AsyncClient,
    AsyncJob,
    Client,
    Job,
    JobCancelled,
    JobFailed,
    JobRestarted,
    QueueFull,
    RedisFull,
)

__all__ = [
    "AsyncClient",
    "AsyncJob",
    "Client",
    "Job",
    "JobCancelled",
    "JobFailed",
    "JobRestarted",
    "QueueFull",
    "RedisFull",
]
