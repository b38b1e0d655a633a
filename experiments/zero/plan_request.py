"""What the training planner is asked: the typed request, its checks, and the candidate grid.

A request is a model shape, a device count and memory, a sequence length and a global batch,
plus the subsets of the grid to search and the rates the ranking assumes. `PlanRequest.validate`
refuses bad input with a ConfigError naming the field before anything is compiled; `check_fields`
checks everything but the model, so that a launcher can refuse a bad flag before it has a model.
Sizes come as text with a unit (`parse_bytes`, `parse_count`). JAX-free: launchers import it at
their top.
"""

from __future__ import annotations

import dataclasses
import math
import re

from experiments.cli.config import ConfigError
from model.config import DTYPES, ModelConfig

GB = 1e9
STRATEGIES = ("dp", "zero1", "zero2", "zero3", "zero3_prefetch")
REMATS = ("none", "save_dots", "full")  # least recomputation (most memory) first
DEFAULT_HEADROOM = 0.10
# The achieved bf16 matmul rate per device the ranking assumes: well below an H100's peak, as
# a real step's mix of matmuls, elementwise work and waiting is.
DEFAULT_TFLOPS = 400.0
DEFAULT_LINK_GB_S = 100.0  # collective bandwidth per device

# ---------------------------------------------------------------- sizes with units

_BYTE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
_QUANTITY = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def _parse_quantity(text: str, units: dict[str, float], field: str, example: str) -> float:
    m = _QUANTITY.fullmatch(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in units or float(m.group(1)) <= 0:
        raise ConfigError(f"{field}={text!r}: expected a positive number with a unit "
                          f"({', '.join(u for u in units if u)}), e.g. {example}")
    return float(m.group(1)) * units[unit]


def parse_bytes(text: str, field: str = "device-memory") -> float:
    """'80GB' -> 80e9, '24GiB' -> 24 * 2**30 (GB = 1e9 bytes, as the ZeRO paper counts)."""
    return _parse_quantity(text, _BYTE_UNITS, field, "80GB")


def parse_count(text: str, field: str = "params") -> float:
    """'70B' -> 70e9, '350M' -> 350e6."""
    return _parse_quantity(text, _COUNT_UNITS, field, "70B")


# ---------------------------------------------------------------- request and candidates


def check_fields(*, devices: int, device_memory: float, seq_len: int, global_batch: int,
                 headroom: float = DEFAULT_HEADROOM, strategies: tuple[str, ...] = STRATEGIES,
                 remats: tuple[str, ...] = REMATS, micro_batches: tuple[int, ...] | None = None,
                 data_sizes: tuple[int, ...] | None = None, tflops: float = DEFAULT_TFLOPS,
                 link_gb_s: float = DEFAULT_LINK_GB_S) -> None:
    """ConfigError naming the first bad field of a request, its model aside."""
    _check_sizes(devices, device_memory, seq_len, global_batch, headroom, tflops, link_gb_s)
    _check_grid(devices, global_batch // devices, strategies, remats, micro_batches, data_sizes)


def _check_sizes(devices, device_memory, seq_len, global_batch, headroom, tflops,
                 link_gb_s) -> None:
    if devices < 1:
        raise ConfigError(f"devices={devices}: must be a positive integer")
    if seq_len < 1:
        raise ConfigError(f"seq={seq_len}: must be a positive integer")
    if global_batch < 1 or global_batch % devices:
        raise ConfigError(f"global-batch={global_batch}: must be a positive multiple "
                          f"of devices={devices} (every device gets whole sequences)")
    if not 0 <= headroom < 1:
        raise ConfigError(f"headroom={headroom}: must be in [0, 1)")
    if not device_memory > 0:
        raise ConfigError(f"device-memory={device_memory}: must be positive")
    for name, value in (("tflops", tflops), ("link-gb-s", link_gb_s)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name}={value}: must be a positive number")


def _check_grid(devices, per_device_batch, strategies, remats, micro_batches,
                data_sizes) -> None:
    for s in strategies:
        if s not in STRATEGIES:
            raise ConfigError(f"strategies: {s!r} not allowed; allowed {', '.join(STRATEGIES)}")
    for r in remats:
        if r not in REMATS:
            raise ConfigError(f"remats: {r!r} not allowed; allowed {', '.join(REMATS)}")
    for m in micro_batches or ():
        if m < 1 or per_device_batch % m:
            raise ConfigError(f"micro-batches: {m} must divide the per-device batch "
                              f"{per_device_batch} (global-batch / devices)")
    for a in data_sizes or ():
        if a < 1 or devices % a:
            raise ConfigError(f"data-sizes: {a} must divide devices={devices}")


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    model: ModelConfig  # shape and dtypes; remat and max_len are set per candidate / request
    devices: int
    device_memory: float  # bytes
    seq_len: int
    global_batch: int  # sequences per optimizer step
    headroom: float = DEFAULT_HEADROOM
    strategies: tuple[str, ...] = STRATEGIES
    remats: tuple[str, ...] = REMATS
    micro_batches: tuple[int, ...] | None = None  # None: every divisor of the per-device batch
    data_sizes: tuple[int, ...] | None = None  # mesh data axis sizes; None: every divisor
    tflops: float = DEFAULT_TFLOPS
    link_gb_s: float = DEFAULT_LINK_GB_S
    shape_note: str = ""

    @property
    def usable(self) -> float:
        return self.device_memory * (1 - self.headroom)

    @property
    def per_device_batch(self) -> int:
        return self.global_batch // self.devices

    def validate(self) -> None:
        """ConfigError naming the field and what is allowed."""
        check_fields(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                        if f.name not in ("model", "shape_note")})
        if self.model.param_dtype not in DTYPES:
            raise ConfigError(f"dtype={self.model.param_dtype!r}: allowed {', '.join(DTYPES)}")
        try:
            dataclasses.replace(self.model, max_len=self.seq_len).validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class Candidate:
    strategy: str
    data: int
    fsdp: int
    remat: str
    micro_batch: int  # sequences per device per micro-step

    @property
    def mesh(self) -> str:
        return f"data={self.data},fsdp={self.fsdp}"

    @property
    def remat_rank(self) -> int:
        return REMATS.index(self.remat)  # 0 = no recomputation

    @property
    def name(self) -> str:
        return f"{self.strategy} {self.mesh} remat={self.remat} micro_batch={self.micro_batch}"

    def needs_at_least_as_much_as(self, other: Candidate) -> bool:
        """self's peak cannot be below other's: same strategy, no more fsdp sharding, no more
        recomputation, no smaller micro-batch (more data replication only adds state)."""
        return (self.strategy == other.strategy and self.fsdp <= other.fsdp
                and self.remat_rank <= other.remat_rank and self.micro_batch >= other.micro_batch)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(req: PlanRequest) -> list[Candidate]:
    """The grid. dp holds and moves the same on every mesh, so it is listed on fsdp=N only;
    meshes whose fsdp size does not divide d_model (every parameter is split along it) are left
    out for the strategies that shard; zero3_prefetch always recomputes (remat full only)."""
    out = []
    micro = req.micro_batches or tuple(_divisors(req.per_device_batch))
    datas = req.data_sizes or tuple(_divisors(req.devices))
    for s in req.strategies:
        for a in datas:
            fsdp = req.devices // a
            if s == "dp" and a != 1:
                continue
            if s != "dp" and req.model.d_model % fsdp:
                continue
            # zero3 with prefetch writes its own layer loop that saves only each layer's input
            # and recomputes the layer: remat=full whatever the setting says.
            remats = req.remats if s != "zero3_prefetch" else \
                tuple(r for r in req.remats if r == "full")
            for r in remats:
                for m in micro:
                    out.append(Candidate(s, a, fsdp, r, m))
    return out
