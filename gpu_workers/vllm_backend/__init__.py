"""The vLLM backend: a worker serves the queue on vLLM's engine instead of the native one.

backend.py implements gpu_workers/backend.py's interface on vLLM's LLMEngine; params.py
maps the wire's sampling fields onto vLLM's; stats.py reads vLLM's per-step figures;
connector.py is a vLLM KV connector onto Plurai's Redis KV tier, kv_layout.py how its
blocks map onto vLLM's cache pages. reaper.py ends the engine's processes when the worker
dies; cores.py binds the engine core to the cores vLLM gives its ranks. vLLM is imported only
here, and lives in its own environment (`make vllm-install`).
"""
