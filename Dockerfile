# One image for every Plurai service (worker, gateway, Celery).
FROM python:3.11-slim
WORKDIR /app
# g++ builds the fused CPU kernels (without it the engine runs its pure-torch path)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# Pass TORCH=torch==2.13.0 --index-url ... to pick a CPU or CUDA build explicitly.
ARG TORCH=torch
RUN pip install --no-cache-dir "${TORCH}"
COPY pyproject.toml README.md ./
COPY cli cli
COPY producer producer
COPY broker_config broker_config
COPY gateway gateway
COPY gpu_workers gpu_workers
COPY kv_store kv_store
COPY results results
RUN pip install --no-cache-dir . && python -m gpu_workers.kernels
ENTRYPOINT ["plurai"]
