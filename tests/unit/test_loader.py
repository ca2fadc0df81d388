"""The model fingerprint covers every byte of every weight file and is cached beside the
model (or under PLURAI_DATA_DIR); the safetensors index cannot point outside the folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from plurai.gpu_workers.models import loader

MB = 1 << 20


def checkpoint(folder: Path, weights: bytes) -> Path:
    """A model folder as the fingerprint sees it: config, tokenizer and one weight file."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    return folder


@pytest.fixture
def weights() -> bytes:
    return os.urandom(5 * MB)  # larger than the head and tail a partial hash would read


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The names of the files whose content the fingerprint reads."""
    names: list[str] = []
    real = loader._file_digest

    def counting(f: Path) -> str:
        names.append(f.name)
        return real(f)

    monkeypatch.setattr(loader, "_file_digest", counting)
    monkeypatch.setenv("PLURAI_DATA_DIR", "/nonexistent/plurai-data")
    return names


def test_one_byte_in_the_middle_of_a_weight_file_changes_the_fingerprint(tmp_path, weights):
    changed = bytearray(weights)
    changed[len(weights) // 2] ^= 1
    a = loader.fingerprint(checkpoint(tmp_path / "a", weights))
    b = loader.fingerprint(checkpoint(tmp_path / "b", bytes(changed)))
    assert a != b and len(a) == len(b) == 32
    assert loader.fingerprint(checkpoint(tmp_path / "c", weights)) == a  # content, not path
    (tmp_path / "c" / "tokenizer.json").write_text('{"changed": 1}')
    assert loader.fingerprint(tmp_path / "c") != a  # the tokenizer is covered too


def test_the_cache_is_reused_until_a_size_or_mtime_changes(tmp_path, weights, hashed):
    model = checkpoint(tmp_path / "m", weights)
    first = loader.fingerprint(model)
    assert sorted(hashed) == ["config.json", "model.safetensors", "tokenizer.json"]
    cache = json.loads((model / loader.CACHE_NAME).read_text())
    assert set(cache["files"]) == {"config.json", "model.safetensors", "tokenizer.json"}
    hashed.clear()
    assert loader.fingerprint(model) == first and hashed == []

    w = model / "model.safetensors"
    st = w.stat()
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched: same bytes, read again
    assert loader.fingerprint(model) == first and hashed == ["model.safetensors"]
    hashed.clear()
    assert loader.fingerprint(model) == first and hashed == []

    # other bytes of the same size with the old mtime put back: the cache cannot tell, by
    # design (size and mtime_ns are the key); a size change can
    with w.open("ab") as f:
        f.write(b"\0")
    assert loader.fingerprint(model) != first and hashed == ["model.safetensors"]
    assert [p.name for p in model.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        "[]",
        '{"version": 1, "files": {"model.safetensors": {"size": 1}}}',
        '{"version": 99, "files": {}}',
        '{"version": 1, "files": {"config.json": {"size": 1, "mtime_ns": 1, "sha256": "zz"}}}',
    ],
)
def test_a_bad_cache_is_ignored_and_rewritten(tmp_path, weights, hashed, bad):
    model = checkpoint(tmp_path / "m", weights)
    first = loader.fingerprint(model)
    (model / loader.CACHE_NAME).write_text(bad)
    hashed.clear()
    assert loader.fingerprint(model) == first and len(hashed) == 3
    hashed.clear()
    assert loader.fingerprint(model) == first and hashed == []


def test_a_forged_cache_entry_only_counts_for_the_file_it_stamps(tmp_path, weights, hashed):
    model = checkpoint(tmp_path / "m", weights)
    first = loader.fingerprint(model)
    path = model / loader.CACHE_NAME
    doc = json.loads(path.read_text())
    doc["files"]["model.safetensors"]["size"] += 1  # no longer matches the file
    doc["files"]["model.safetensors"]["sha256"] = "0" * 64
    path.write_text(json.dumps(doc))
    hashed.clear()
    assert loader.fingerprint(model) == first and hashed == ["model.safetensors"]


def test_a_read_only_model_folder_caches_under_the_data_dir(tmp_path, weights, hashed, monkeypatch):
    model = checkpoint(tmp_path / "m", weights)
    (model / loader.CACHE_NAME).mkdir()  # cannot be written or read, even by root
    monkeypatch.setenv("PLURAI_DATA_DIR", str(tmp_path / "data"))
    first = loader.fingerprint(model)
    (cached,) = (tmp_path / "data" / "fingerprints").iterdir()
    assert cached == loader.fingerprint_cache(model)[1]
    assert set(json.loads(cached.read_text())["files"]) == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    }
    hashed.clear()
    assert loader.fingerprint(model) == first and hashed == []


def sharded(folder: Path, weight_map: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / loader.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_the_index_cannot_point_outside_the_model_folder(tmp_path):
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"not yours")
    model = tmp_path / "m"
    (model / "shards").mkdir(parents=True)
    (model / "shards" / "a.safetensors").write_bytes(b"a")
    (model / "inside-link.safetensors").symlink_to(model / "shards" / "a.safetensors")
    (model / "escape.safetensors").symlink_to(outside)
    (model / "up").symlink_to(tmp_path)

    ok = {"x": "shards/a.safetensors", "y": "inside-link.safetensors"}
    sharded(model, ok)
    assert [p.name for p in loader.weight_files(model)] == [
        "inside-link.safetensors",
        "a.safetensors",
    ]
    loader.fingerprint(model)
    for bad, why in [
        ("../secret.safetensors", "outside"),
        (str(outside), "outside"),
        ("shards/../../secret.safetensors", "outside"),
        ("escape.safetensors", "link that leads outside"),
        ("up/secret.safetensors", "link that leads outside"),
        ("", "not a plain file name"),
        ("..\\secret.safetensors", "not a plain file name"),
    ]:
        sharded(model, {**ok, "z": bad})
        for read in (loader.weight_files, loader.fingerprint):
            with pytest.raises(ValueError, match=why):
                read(model)
    for not_a_name in (None, 3, ["a"]):
        (model / loader.INDEX).write_text(json.dumps({"weight_map": {"z": not_a_name}}))
        with pytest.raises(ValueError, match="not a plain file name"):
            loader.weight_files(model)
    (model / loader.INDEX).write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a safetensors index"):
        loader.weight_files(model)


def test_the_data_dir_of_the_config_file_holds_the_cache(tmp_path, weights, hashed, monkeypatch):
    """data_dir set in the PLURAI_CONFIG file, not the environment, is where a read-only
    model folder's digests go."""
    model = checkpoint(tmp_path / "m", weights)
    (model / loader.CACHE_NAME).mkdir()
    monkeypatch.delenv("PLURAI_DATA_DIR")
    config = tmp_path / "plurai.toml"
    config.write_text(f"data_dir = {str(tmp_path / 'state')!r}\n")
    monkeypatch.setenv("PLURAI_CONFIG", str(config))
    first = loader.fingerprint(model)
    (cached,) = (tmp_path / "state" / "fingerprints").iterdir()
    assert cached == loader.fingerprint_cache(model)[1]
    hashed.clear()
    assert loader.fingerprint(model) == first and hashed == []
