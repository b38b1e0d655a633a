"""Byte-level text data: corpus, deterministic split, packing, resumable seeded order.

The default corpus is the Python standard library's sources of the running interpreter, which
every machine with Python has. Files are split into train/validation by a hash of their relative
path (stable across runs and machines, independent of random state), concatenated with a NUL
separator, and cut into fixed-length sequences of `seq_len + 1` bytes (inputs and shifted targets).
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from experiments.cli.config import ConfigError
from experiments.training import pydoc_corpus

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
_SEPARATOR = b"\0"


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path) -> list[Path]:
    """All text files under `root` in a deterministic order (a single file is its own list)."""
    if root.is_file():
        return [root]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(TEXT_SUFFIXES))
    return out


def is_validation(rel_path: str, val_percent: int) -> bool:
    return zlib.crc32(rel_path.encode()) % 100 < val_percent


def _read(path: Path, data: str | None) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"data={data!r}: cannot read {path} ({e.strerror})") from None


def _check_text_file(raw: bytes, data: str) -> None:
    """A file named on its own must be text: a binary one (an archive, a checkpoint passed by
    mistake) would otherwise train silently on noise. Folders are read as bytes, because real
    source trees (the default corpus included) hold a few files in other encodings."""
    allowed = "allowed: a non-empty UTF-8 text file, or a folder of .py .txt .md .rst files"
    if not raw:
        raise ConfigError(f"data={data!r}: the file is empty; {allowed}")
    nul = raw.find(_SEPARATOR)
    if nul >= 0:
        raise ConfigError(f"data={data!r}: binary, a NUL byte at offset {nul}; {allowed}")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data={data!r}: not UTF-8 text (byte {e.start}); {allowed}") from None


def load_corpus(path: str | None, val_percent: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(train_bytes, val_bytes) as uint8 arrays. A single file is split by position instead.
    Raises ConfigError naming `data` for a missing, unreadable, empty or binary path."""
    root = Path(path) if path else default_corpus_root()
    if not root.exists():
        raise ConfigError(f"data={path!r}: no such file or folder")
    files = list_files(root)
    if root.is_file():
        raw = _read(root, path)
        _check_text_file(raw, path)
        cut = len(raw) - len(raw) * val_percent // 100
        train, val = raw[:cut], raw[cut:]
    else:
        parts = {True: [], False: []}
        for f in files:
            parts[is_validation(str(f.relative_to(root)), val_percent)].append(_read(f, path))
        train, val = _SEPARATOR.join(parts[False]), _SEPARATOR.join(parts[True])
    if not train or not val:
        raise ConfigError(f"data={path!r}: holds no text for both a train and a validation split "
                          f"(files found: {len(files)}, {val_percent}% to validation); "
                          f"{_split_advice(root, files)}")
    return np.frombuffer(train, np.uint8), np.frombuffer(val, np.uint8)


def split_sizes(root: Path) -> dict[int, tuple[int, int]]:
    """{val_percent: (train bytes, validation bytes)} for every allowed val_percent: a file is
    split by position, a folder's files by the hash of their path (separators not counted)."""
    if root.is_file():
        n = root.stat().st_size
        return {vp: (n - n * vp // 100, n * vp // 100) for vp in range(1, 100)}
    files = [(f.stat().st_size, zlib.crc32(str(f.relative_to(root)).encode()) % 100)
             for f in list_files(root)]
    total = sum(size for size, _ in files)
    out = {}
    for vp in range(1, 100):
        val = sum(size for size, bucket in files if bucket < vp)
        out[vp] = (total - val, val)
    return out


def val_percent_for(root: Path, val_bytes: int, train_bytes: int = 1) -> int | None:
    """The smallest val_percent that holds out at least `val_bytes` and keeps `train_bytes`
    to train on, or None when none does."""
    for vp, (train, val) in split_sizes(root).items():
        if val >= val_bytes and train >= train_bytes:
            return vp
    return None


def _split_advice(root: Path, files: list[Path]) -> str:
    """What would split this folder: a val_percent that puts text on both sides, if any."""
    if not files:
        return f"add text files ({' '.join(TEXT_SUFFIXES)}) or give a text file"
    if len(files) == 1:
        return (f"a folder of one file cannot be split by file: give the file itself "
                f"(--data {files[0]}), which is split by position")
    vp = val_percent_for(root, 1)
    if vp is None:
        return ("no --val-percent splits its files (each split goes by a hash of the file's "
                "path); give a single file, which is split by position, or add files")
    return f"--val-percent {vp} puts files on both sides (the split goes by the file's path)"


def fit_advice(path: str | None, val_rows: int, micro_batch: int, micro_steps: int,
               n_dev: int, seq_len: int, tokens_per_byte: float) -> str:
    """What would make a validation split of `val_rows` sequences give one batch: the largest
    batch_size that fits it and divides over the devices, and (for a --data path) the
    val_percent that holds out enough text."""
    options = []
    fits = val_rows // n_dev * n_dev
    if fits >= 1:
        options.append(f"--batch-size {fits * micro_steps} (fits the split and divides over "
                       f"the {n_dev} devices)")
    if path is not None and Path(path).exists():
        need = int((micro_batch * seq_len + 1) / tokens_per_byte) + 1
        vp = val_percent_for(Path(path), need, train_bytes=need)
        if vp is not None:
            options.append(f"--val-percent {vp} (about {micro_batch} validation sequences)")
    if not options:
        return "more text, or a shorter --max-len"
    return "give " + " or ".join(options)


def load_tokens(path: str | None, val_percent: int, corpus: str = "stdlib",
                encode=None) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token streams: `path` (or the named corpus: the stdlib sources, or the
    pydoc_data documentation topics split by topic name) as bytes, or, with a tokenizer's
    `encode`, its token ids (a pretrained model's vocabulary)."""
    if path is None and corpus == "pydoc-topics":
        train, val = (np.frombuffer(pydoc_corpus.split_text(split, val_percent).encode(),
                                    np.uint8) for split in ("train", "validation"))
    else:
        train, val = load_corpus(path, val_percent)
    if encode is None:
        return train, val
    return tuple(np.asarray(encode(part.tobytes().decode("utf-8", errors="replace")), np.int32)
                 for part in (train, val))


def pack(stream: np.ndarray, seq_len: int, bos: int | None = None) -> np.ndarray:
    """Non-overlapping rows of seq_len+1 tokens; the ragged tail is dropped. With `bos` (the
    id a tokenizer starts every text with), each row is `bos` then seq_len tokens of the stream:
    a model pretrained with it at position 0 (Gemma) sees every window start as its texts did."""
    if bos is not None:
        stream = stream[1:] if len(stream) and stream[0] == bos else stream
        n = len(stream) // seq_len
    else:
        n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"seq_len={seq_len}: longer than the whole split ({len(stream)} bytes)")
    if bos is not None:
        rows = stream[:n * seq_len].reshape(n, seq_len).astype(np.int32)
        return np.concatenate([np.full((n, 1), bos, np.int32), rows], axis=1)
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx].astype(np.int32)


def bos_of(tokenizer) -> int | None:
    """The id every text of `tokenizer` starts with (None: bytes, or a tokenizer without one)."""
    return tokenizer.bos[0] if tokenizer is not None and tokenizer.bos else None


@dataclasses.dataclass
class SequenceSampler:
    """Seeded epoch-wise shuffled order with an exact position (sequences consumed so far).

    `position` is all the state there is: saving it and restoring it resumes the exact order.
    Each process asks only for its own rows of the global batch.
    """

    rows: np.ndarray
    seed: int
    position: int = 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def global_indices(self, start: int, count: int) -> np.ndarray:
        n = len(self.rows)
        k = np.arange(start, start + count)
        epochs = k // n
        out = np.empty(count, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._order(int(e))[k[sel] % n]
        return out

    def next_batch(self, global_batch: int, process_index: int = 0,
                   process_count: int = 1) -> np.ndarray:
        """This process's slice [B/P, seq_len+1] of the next global batch; advances position."""
        per = global_batch // process_count
        idx = self.global_indices(self.position + process_index * per, per)
        self.position += global_batch
        return self.rows[idx]


def validation_batches(rows: np.ndarray, global_batch: int, max_batches: int) -> list[np.ndarray]:
    """The fixed validation set: max_batches full batches of rows spread evenly over the split
    (so every part of the validation files is represented, not just the first files)."""
    n = min(max_batches, len(rows) // global_batch)
    if n < 1:
        raise ValueError(f"batch_size={global_batch}: larger than the validation split "
                         f"({len(rows)} sequences)")
    picked = rows[np.linspace(0, len(rows) - 1, n * global_batch).astype(np.int64)]
    return [picked[i * global_batch:(i + 1) * global_batch] for i in range(n)]
