"""Plurai client SDK: `Client` (sync) and `AsyncClient` (asyncio)."""

from plurai.producer.aio import AsyncClient, AsyncJob
from plurai.producer.client import Client, Job
from plurai.producer.errors import JobCancelled, JobFailed, JobRestarted, QueueFull, RedisFull

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
