"""Plurai client SDK: `Client` (sync) and `AsyncClient` (asyncio)."""

from producer.aio import AsyncClient, AsyncJob
from producer.client import Client, Job
from producer.errors import JobCancelled, JobFailed, JobRestarted, QueueFull, RedisFull

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
