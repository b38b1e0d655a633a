"""Run configuration: typed dataclasses, named presets, command-line overrides.

Importing this module does not import JAX, so launchers can parse arguments and set XLA_FLAGS
(fake CPU devices) before JAX starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import typing
from pathlib import Path

from model.config import MODEL_PRESETS, ModelConfig
from parallel.strategies import STRATEGIES


class ConfigError(ValueError):
    """Bad input: the launcher prints it on one line (`fail`) and exits with status 2."""


# The interpreter of the separate PyTorch environment (torch, transformers; never a dependency of
# this project): the launchers with a PyTorch side take it as their --torch-python default, and
# experiments.reproduce runs the experiments that need it only when it is set.
TORCH_PYTHON_ENV = "SHARDQ_TORCH_PYTHON"

# Seeds feed numpy's Generator (which refuses negative seeds) and jax.random.key, which keeps only
# the low 32 bits with 64-bit types off (2**32 and 0 would give the same run).
SEED_LIMIT = 2**32

BYTE_VOCAB = 256  # the corpus is raw bytes: token ids 0..255
CORPORA = ("stdlib", "pydoc-topics")
PRETRAINED_INITS = ("smollm2",)

# What each float field allows besides being finite (`not lr > 0` lets inf through). A float
# field without an entry only has to be finite.
_FLOAT_RULES = {
    "lr": (lambda v: v > 0, "> 0"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "b1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "b2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    # The step scales the gradient by min(1, clip_norm / norm): 0 freezes the model and a
    # negative value reverses the update; there is no "off" value, a large one never clips.
    "clip_norm": (lambda v: v > 0, "> 0"),
    "rope_base": (lambda v: v > 0, "> 0"),
    "norm_eps": (lambda v: v > 0, "> 0"),
}


def check_floats(obj) -> None:
    """Every float field of the config dataclass `obj` is finite and within _FLOAT_RULES."""
    for f in dataclasses.fields(obj):
        if _field_type(type(obj), f) is not float:
            continue
        value = getattr(obj, f.name)
        test, allowed = _FLOAT_RULES.get(f.name, (lambda v: True, ""))
        if not (math.isfinite(value) and test(value)):
            raise ConfigError(f"{f.name}={value}: must be a finite number {allowed}".rstrip())


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


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 64  # global batch, in sequences, per optimizer step
    micro_steps: int = 1  # gradient accumulation: batch_size is split into this many micro-batches
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    seed: int = 0
    eval_every: int = 200
    eval_batches: int = 16
    log_every: int = 10
    ckpt_every: int = 200
    keep_ckpts: int = 2
    strategy: str = "dp"
    prefetch: bool = False  # zero3 only: gather layer i+1 while layer i computes
    mesh: str | None = None  # "data=A,fsdp=B"; default: every device on fsdp
    devices: int | None = None  # fake this many CPU devices (default 8 on a CPU-only machine)
    data: str | None = None  # text file or folder; default: the corpus named by `corpus`
    corpus: str = "stdlib"  # stdlib: the Python standard library's sources; pydoc-topics: the
    # documentation topics of pydoc_data (experiments/training/pydoc_corpus.py; a train/validation
    # split)
    init: str | None = None  # start from pretrained weights (smollm2); the data is then
    # tokenized with that model's tokenizer instead of read as bytes
    val_percent: int = 5
    on_nonfinite: str = "stop"  # a NaN/Inf loss or gradient: stop the run, or skip that step

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field and what it allows."""
        for name in ("steps", "batch_size", "micro_steps", "eval_every", "eval_batches",
                     "log_every", "ckpt_every", "keep_ckpts"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be a positive integer")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"warmup_steps={self.warmup_steps}: must be in 0..steps "
                              f"({self.steps})")
        check_floats(self)
        check_seed(self.seed)
        if self.batch_size % self.micro_steps:
            raise ConfigError(f"micro_steps={self.micro_steps}: must divide "
                              f"batch_size={self.batch_size}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy={self.strategy!r}: allowed {', '.join(STRATEGIES)}")
        if self.prefetch and self.strategy != "zero3":
            raise ConfigError(f"prefetch=True: only for strategy zero3, not {self.strategy!r}")
        if self.devices is not None:
            check_devices(self.devices)
        if self.data is not None and not self.data.strip():
            raise ConfigError("data='': must be a file or folder (leave --data out for the "
                              "default corpus)")
        if self.corpus not in CORPORA:
            raise ConfigError(f"corpus={self.corpus!r}: allowed {', '.join(CORPORA)}")
        if self.init is not None and self.init not in PRETRAINED_INITS:
            raise ConfigError(f"init={self.init!r}: allowed {', '.join(PRETRAINED_INITS)}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r}: allowed stop, skip")
        if not 0 < self.val_percent < 100:
            raise ConfigError(f"val_percent={self.val_percent}: must be in 1..99")


@dataclasses.dataclass(frozen=True)
class Config:
    preset: str
    model: ModelConfig
    train: TrainConfig

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field of the model or the training config."""
        try:
            self.model.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        check_floats(self.model)
        if self.train.init is None and self.model.vocab_size < BYTE_VOCAB:
            raise ConfigError(f"vocab_size={self.model.vocab_size}: must be >= {BYTE_VOCAB}; "
                              f"the training data is bytes (token ids 0..{BYTE_VOCAB - 1})")
        self.train.validate()

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict) -> Config:
        """The config a run wrote (config.json); TypeError or KeyError if it is not one, a
        field of the wrong type included (validate() compares numbers)."""
        cfg = Config(d["preset"], ModelConfig(**d["model"]), TrainConfig(**d["train"]))
        for part in (cfg.model, cfg.train):
            for f in dataclasses.fields(part):
                value, kind = getattr(part, f.name), _field_type(type(part), f)
                if not (_is_a(value, kind) or (value is None and f.default is None)):
                    article = "an" if kind.__name__[0] in "aeiou" else "a"
                    raise TypeError(f"{f.name}={value!r} is not {article} {kind.__name__}")
        return cfg


# The runnable presets (the large model shapes in MODEL_PRESETS are only compiled abstractly).
PRESETS: dict[str, Config] = {
    "tiny": Config("tiny", MODEL_PRESETS["tiny"], TrainConfig(
        steps=20, batch_size=16, lr=3e-3, warmup_steps=2, eval_every=10, eval_batches=2,
        log_every=1, ckpt_every=10)),
    # The main job: tuned on a 2-core CPU with 8 fake devices to reach < 2.5 bits/byte within the
    # 10-minute budget (see README "Main job").
    "small": Config("small", MODEL_PRESETS["small"], TrainConfig(
        steps=1500, batch_size=32, lr=6e-3, warmup_steps=50, eval_every=500, eval_batches=16,
        log_every=10, ckpt_every=500)),
    "medium": Config("medium", MODEL_PRESETS["medium"], TrainConfig(
        steps=5000, batch_size=64, lr=1e-3, warmup_steps=200, eval_every=500, eval_batches=32,
        ckpt_every=500)),
    # Fine-tuning SmolLM2-135M-Instruct on the pydoc topics under ZeRO-3 (experiments.finetune):
    # bf16 working weights and compute, fp32 master weights and moments, remat, a short context;
    # sized for about ten minutes on a 2-core CPU with 8 fake devices.
    "smollm2": Config("smollm2", dataclasses.replace(
        MODEL_PRESETS["smollm2"], max_len=128, param_dtype="bfloat16", compute_dtype="bfloat16",
        remat="full"), TrainConfig(
        steps=24, batch_size=8, lr=1e-4, warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.0,
        eval_every=12, eval_batches=4, log_every=1, ckpt_every=12, strategy="zero3",
        corpus="pydoc-topics", init="smollm2", val_percent=20)),
}


def _field_type(cls, field: dataclasses.Field):
    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and typing.get_origin(hint) is not tuple else hint


def _is_a(value, kind) -> bool:
    """JSON's value for a field of this type (bool is not an int; an int is a float); other
    types (tuples) are left to validate()."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind in (str, bool):
        return isinstance(value, kind)
    return True


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: expected true or false")


def _parse_names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_field_flags(parser: argparse.ArgumentParser, cls, *, title: str,
                    skip: set[str] = frozenset(), aliases: dict[str, str] | None = None) -> None:
    """One --flag per dataclass field (`--d-model 256`, `--clip-search`, `--rules a,b`), stored
    as `override_<field>` and None when not given (the preset or the class default then
    holds). A field's `help` metadata becomes its help."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = _field_type(cls, f)
        names = ["--" + f.name.replace("_", "-")]
        if aliases and f.name in aliases:
            names.append(aliases[f.name])
        extra = {}
        if kind is bool:  # `--flag` alone means true; `--flag false` also works
            extra = dict(type=_parse_bool, nargs="?", const=True)
        else:
            extra = dict(type=_parse_names if typing.get_origin(kind) is tuple else kind)
        group.add_argument(*names, dest=f"override_{f.name}", default=None,
                           metavar=f.name.upper(), help=f.metadata.get("help"), **extra)


def field_overrides(args: argparse.Namespace, cls) -> dict:
    """{field: value} of the flags `add_field_flags` made for cls that were given."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k[len("override_"):]: v for k, v in vars(args).items()
            if k.startswith("override_") and v is not None and k[len("override_"):] in names}


def add_override_flags(parser: argparse.ArgumentParser, skip: set[str] = frozenset()) -> None:
    """One --flag per model and training config field, defaulting to the preset."""
    for cls in (ModelConfig, TrainConfig):
        add_field_flags(parser, cls, skip=skip,
                        title="config overrides (default: the preset's value)")


def config_from_args(args: argparse.Namespace, base: Config | None = None) -> Config:
    """Preset (or `base`: a run's own config, which --resume continues) + the flags given;
    raises ConfigError naming the bad field."""
    if base is None:
        if args.preset not in PRESETS:
            raise ConfigError(f"preset={args.preset!r}: allowed {', '.join(PRESETS)}")
        base = PRESETS[args.preset]
    cfg = Config(base.preset,
                 dataclasses.replace(base.model, **field_overrides(args, ModelConfig)),
                 dataclasses.replace(base.train, **field_overrides(args, TrainConfig)))
    cfg.validate()
    return cfg


def check_sampling(model: ModelConfig, prompt_len: int, max_new_tokens: int, temperature: float,
                   top_k: int, seed: int) -> None:
    """Sampling settings against the trained model; raises ConfigError naming the field."""
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
        raise ConfigError(f"prompt: {prompt_len} bytes; must be shorter than the context of "
                          f"{model.max_len}")
    if prompt_len + max_new_tokens > model.max_len:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: prompt ({prompt_len} bytes) + new "
                          f"tokens must fit the context of {model.max_len}")


def load_config(workdir: str | Path) -> Config:
    """The run config a training run wrote to WORKDIR/config.json (JAX-free: a launcher reads
    it, and refuses a work dir without one, before JAX starts)."""
    path = Path(workdir) / "config.json"
    try:
        if not path.is_file():
            raise ConfigError(f"workdir={str(workdir)!r}: no config.json; train a model there "
                              f"first")
        text = path.read_text(encoding="utf-8")
    except OSError as e:  # a folder or file this user may not read
        raise ConfigError(f"workdir={str(workdir)!r}: config.json cannot be read "
                          f"({e.strerror or e})") from None
    try:
        return Config.from_json(json.loads(text))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"workdir={str(workdir)!r}: config.json is not a shardq config ({e})") \
            from None


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


def dumps(cfg: Config) -> str:
    return json.dumps(cfg.to_json(), indent=2, sort_keys=True)
