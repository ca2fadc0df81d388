"""The `plurai` command (cli/main.py) and `make demo` (cli/demo.py).

The top of the import layering: the command both talks to the queue as a client
(producer/) and starts workers (gpu_workers/serve.py), so it lives above both; producer/
stays the client SDK, importing nothing of gpu_workers. `python -m plurai.cli ...` is `plurai ...`.
"""
