"""The batch driver says at its start why it cannot split documents, rather than only in
every document's error line (model_unavailable)."""

from __future__ import annotations

from plurai.broker_config.settings import Settings
from plurai.producer.bulk.tasks import check_model_dir


def test_a_driver_without_a_usable_model_dir_says_why(monkeypatch, tmp_path, tiny_model):
    monkeypatch.delenv("PLURAI_MODEL_DIR", raising=False)
    assert "PLURAI_MODEL_DIR is not set" in check_model_dir(Settings())
    monkeypatch.setenv("PLURAI_MODEL_DIR", str(tmp_path))  # a folder with no tokenizer
    problem = check_model_dir(Settings())
    assert problem.startswith(f"PLURAI_MODEL_DIR={tmp_path}: its tokenizer cannot be loaded")
    monkeypatch.setenv("PLURAI_MODEL_DIR", str(tiny_model))
    assert check_model_dir(Settings()) is None
