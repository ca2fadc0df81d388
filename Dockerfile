# One image for every Plurai service (worker, gateway, Celery).
FROM python:3.11-slim
WORKDIR /app
# g++ builds the fused CPU kernels (without it the engine runs its pure-torch path)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# The torch build: TORCH names it (--build-arg TORCH=torch==2.13.0), TORCH_INDEX the index
# to take it from, e.g. --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu for
# the CPU-only build; unset, pip's own index (the CUDA build on Linux).
ARG TORCH=torch
ARG TORCH_INDEX=
RUN pip install --no-cache-dir ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "${TORCH}"
COPY pyproject.toml README.md ./
COPY cli cli
COPY producer producer
COPY broker_config broker_config
COPY gateway gateway
COPY gpu_workers gpu_workers
COPY kv_store kv_store
COPY results results
COPY plurai plurai
RUN pip install --no-cache-dir '.[all]' && python -m plurai.gpu_workers.kernels
ENTRYPOINT ["plurai"]
