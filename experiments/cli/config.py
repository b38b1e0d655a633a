"""The launchers' one contract for bad input, and the checks every launcher shares.

`ConfigError` is bad input; `fail` prints it as one line (`prog: error: ...`) and exits with
status 2; `Parser` holds argparse to the same line. The `check_*` helpers refuse an output path,
a device count, a seed, a text or sampling settings before any work starts. Importing this
module does not import JAX, so launchers check their flags before JAX starts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import typing
from pathlib import Path

from model.config import ModelConfig


class ConfigError(ValueError):
    """Bad input: the launcher prints it on one line (`fail`) and exits with status 2."""


# The interpreter of the separate PyTorch environment (torch, transformers; never a dependency of
# this project): the launchers with a PyTorch side take it as their --torch-python default, and
# experiments.reproduce runs the experiments that need it only when it is set.
TORCH_PYTHON_ENV = "SHARDQ_TORCH_PYTHON"

# Seeds feed numpy's Generator (which refuses negative seeds) and jax.random.key, which keeps only
# the low 32 bits with 64-bit types off (2**32 and 0 would give the same run).
SEED_LIMIT = 2**32


def check_text(field: str, text: str, *, blank_ok: bool = False) -> None:
    """A text from the command line for a tokenizer: not empty (nor blank, unless `blank_ok`)
    and valid UTF-8. Python hands undecodable argv bytes over as lone surrogates, which no
    tokenizer takes; the error names the first such byte."""
    if not (text if blank_ok else text.strip()):
        raise ConfigError(f"{field}: empty; give at least one "
                          f"{'character' if blank_ok else 'non-blank character'}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])  # argv's undecodable byte b arrives as U+DC00 + b
        what = (f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF
                else f"lone surrogate U+{code:04X}")
        raise ConfigError(f"{field}: not valid UTF-8 ({what} at character {e.start}); give "
                          f"UTF-8 text") from None


def check_replaceable_folder(field: str, path: str | Path, what: str, owned) -> None:
    """An output folder a command replaces whole: it may be missing, empty, or hold what
    `owned(path)` recognises as this command's own earlier output. Anything else (a file, a
    folder of other things) is refused, so that a mistyped path never deletes a user's
    files."""
    check_output_folder(field, path, what)
    p = Path(path)
    if p.exists() and any(p.iterdir()) and not owned(p):
        raise ConfigError(f"{field}={str(path)!r}: holds other files; give a new or empty "
                          f"folder, or one that holds {what} (it is replaced)")


def _check_creatable(field: str, p: Path, what: str) -> None:
    """The nearest existing folder above `p` must be a folder this process may write in."""
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{field}={str(p)!r}: {str(parent)!r} is a file; give a path for "
                          f"{what} under a folder")
    try:  # a real write: permission bits do not stop root, and /proc refuses files anyway
        fd, probe = tempfile.mkstemp(prefix=".shardq-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{field}={str(p)!r}: cannot write in {str(parent)!r} "
                          f"({e.strerror}); give a path for {what} in a writable folder") from None


def check_output_file(field: str, path: str | Path, what: str = "the results file") -> None:
    """A file a command writes (JSON results, a plot): a non-empty path that is not a folder,
    under a folder that exists or can be made and is writable. Checked before the work starts,
    so a mistyped path costs nothing and leaves nothing half-written."""
    if not str(path).strip():
        raise ConfigError(f"{field}: empty; give a file path for {what}")
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{field}={str(path)!r}: is a folder; give a file path for {what}")
    _check_creatable(field, p, what)


def check_output_folder(field: str, path: str | Path, what: str) -> None:
    """A folder a command writes into: a non-empty path (\"\" would be the current folder)
    that is not a file, and can be made under a writable folder."""
    if not str(path).strip():
        raise ConfigError(f"{field}: empty; give a folder path for {what}")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{field}={str(path)!r}: is a file; give a folder for {what}")
    if not p.exists():
        _check_creatable(field, p, what)


# Fake CPU devices are threads of one process; XLA's CPU client takes the count as a C int and
# a run with thousands of them spends its time in start-up. Real clusters use jax.distributed.
MAX_CPU_DEVICES = 1024


def check_devices(n: int) -> None:
    if not 1 <= n <= MAX_CPU_DEVICES:
        raise ConfigError(f"devices={n}: must be in 1..{MAX_CPU_DEVICES} (fake CPU devices of "
                          f"one process; more machines join with jax.distributed)")


def check_seed(seed: int) -> None:
    if not 0 <= seed < SEED_LIMIT:
        raise ConfigError(f"seed={seed}: must be an integer in 0..{SEED_LIMIT - 1}")


def check_sampling(model: ModelConfig, prompt_len: int, max_new_tokens: int, temperature: float,
                   top_k: int, seed: int, unit: str = "bytes") -> None:
    """Sampling settings against the trained model; raises ConfigError naming the field.
    `unit`: what the model's tokens are (bytes, or a tokenizer's tokens)."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: must be a positive integer")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"temperature={temperature}: must be a finite number >= 0 (0 = greedy)")
    if not 0 <= top_k <= model.vocab_size:
        raise ConfigError(f"top_k={top_k}: must be in 0..{model.vocab_size}, the vocabulary size "
                          f"(0 = no top-k cut)")
    check_seed(seed)
    if prompt_len < 1:
        raise ConfigError("prompt: must not be empty")
    if prompt_len >= model.max_len:
        raise ConfigError(f"prompt: {prompt_len} {unit}; must be shorter than the context of "
                          f"{model.max_len}")
    if prompt_len + max_new_tokens > model.max_len:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: prompt ({prompt_len} {unit}) + new "
                          f"tokens must fit the context of {model.max_len}")


def error_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one line: its type and the first line of its message (at most `limit`
    characters), where a result records a failure instead of stopping."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"


def fail(prog: str, message: str, code: int = 2) -> typing.NoReturn:
    """The one-line error every launcher prints for bad input."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(code)


class Parser(argparse.ArgumentParser):
    """argparse under the same contract: an unknown, missing or mistyped flag is one line
    (`prog: error: ...`, exit 2) instead of the usage block and then the error; `--help` still
    prints the whole usage."""

    def error(self, message: str) -> typing.NoReturn:
        if message.endswith("expected one argument"):  # argparse reads "-x" as another flag
            message += "; a value that starts with '-' is given as --flag=VALUE"
        fail(self.prog, f"{message} (see --help)")
