"""What the training planner is asked: the typed request, its checks, and the candidate grid.

A request is a model shape, a device count and memory, a sequence length and a global batch,
plus the subsets of the grid to search and the rates the ranking assumes. `PlanRequest.validate`
refuses bad input with a ConfigError naming the field before anything is compiled. Sizes come
as text with a unit (`parse_bytes`, `parse_count`); `--params` picks a member of our GPT family
(`family_shape`, `family_width_for`).
"""

from __future__ import annotations

import dataclasses
import math
import re

from experiments.cli.config import ConfigError
from model.config import DTYPES, MODEL_PRESETS, ModelConfig
from model.flops import param_count

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


# ---------------------------------------------------------------- the GPT family

# Our GPT family: the GPT-3-style presets' (width, depth) points, depth interpolated log-linearly
# in width between them (and extended along the end segments), head dim 128, d_ff = 4 d_model,
# byte vocabulary. Every one of these presets is a member.
FAMILY_PRESETS = ("1.3b", "7.5b", "128b", "1t")
HEAD_DIM = 128
WIDTH_STEP = 128  # widths searched are multiples of this (the head dim)


def _family_points() -> list[tuple[int, int]]:
    return [(MODEL_PRESETS[p].d_model, MODEL_PRESETS[p].n_layers) for p in FAMILY_PRESETS]


def family_depth(d_model: int) -> int:
    pts = _family_points()
    logd = math.log(d_model)
    i = 0
    while i < len(pts) - 2 and logd > math.log(pts[i + 1][0]):
        i += 1
    (d0, l0), (d1, l1) = pts[i], pts[i + 1]
    slope = (math.log(l1) - math.log(l0)) / (math.log(d1) - math.log(d0))
    return max(1, round(math.exp(math.log(l0) + slope * (logd - math.log(d0)))))


def family_shape(d_model: int, *, seq_len: int = 2048, dtype: str = "bfloat16",
                 remat: str = "full") -> ModelConfig:
    """The member of width d_model (a multiple of WIDTH_STEP)."""
    return ModelConfig(vocab_size=256, d_model=d_model, n_layers=family_depth(d_model),
                       n_heads=max(1, d_model // HEAD_DIM), d_ff=4 * d_model, max_len=seq_len,
                       param_dtype=dtype, compute_dtype=dtype, remat=remat)


def family_width_for(psi: float, max_width: int = 1 << 17) -> int:
    """The member width (multiple of WIDTH_STEP) whose parameter count is closest to psi."""
    lo, hi = 1, max_width // WIDTH_STEP
    while lo < hi:  # smallest width with at least psi parameters
        mid = (lo + hi) // 2
        if param_count(family_shape(mid * WIDTH_STEP)) >= psi:
            hi = mid
        else:
            lo = mid + 1
    cands = [w for w in (lo - 1, lo) if w >= 1]
    return WIDTH_STEP * min(cands, key=lambda w: abs(param_count(family_shape(w * WIDTH_STEP))
                                                     - psi))


def describe_shape(cfg: ModelConfig) -> str:
    kv = f", n_kv_heads {cfg.n_kv_heads}" if cfg.n_kv_heads else ""
    n = param_count(cfg)
    size = next(f"{n / scale:.3g}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K"),
                                                              (1, "")) if n >= scale or scale == 1)
    return (f"d_model {cfg.d_model}, n_layers {cfg.n_layers}, n_heads {cfg.n_heads}{kv}, "
            f"d_ff {cfg.d_ff}, vocab {cfg.vocab_size} ({size} params)")


# ---------------------------------------------------------------- request and candidates


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
        self._check_sizes()
        self._check_grid()
        if self.model.param_dtype not in DTYPES:
            raise ConfigError(f"dtype={self.model.param_dtype!r}: allowed {', '.join(DTYPES)}")
        try:
            dataclasses.replace(self.model, max_len=self.seq_len).validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_sizes(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"devices={self.devices}: must be a positive integer")
        if self.seq_len < 1:
            raise ConfigError(f"seq={self.seq_len}: must be a positive integer")
        if self.global_batch < 1 or self.global_batch % self.devices:
            raise ConfigError(f"global-batch={self.global_batch}: must be a positive multiple "
                              f"of devices={self.devices} (every device gets whole sequences)")
        if not 0 <= self.headroom < 1:
            raise ConfigError(f"headroom={self.headroom}: must be in [0, 1)")
        if not self.device_memory > 0:
            raise ConfigError(f"device-memory={self.device_memory}: must be positive")
        for name in ("tflops", "link_gb_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"{name.replace('_', '-')}={getattr(self, name)}: must be a "
                                  f"positive number")

    def _check_grid(self) -> None:
        for s in self.strategies:
            if s not in STRATEGIES:
                raise ConfigError(f"strategies: {s!r} not allowed; allowed "
                                  f"{', '.join(STRATEGIES)}")
        for r in self.remats:
            if r not in REMATS:
                raise ConfigError(f"remats: {r!r} not allowed; allowed {', '.join(REMATS)}")
        for m in self.micro_batches or ():
            if m < 1 or self.per_device_batch % m:
                raise ConfigError(f"micro-batches: {m} must divide the per-device batch "
                                  f"{self.per_device_batch} (global-batch / devices)")
        for a in self.data_sizes or ():
            if a < 1 or self.devices % a:
                raise ConfigError(f"data-sizes: {a} must divide devices={self.devices}")


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


def request_json(req: PlanRequest) -> dict:
    return {"shape": describe_shape(req.model), "shape_note": req.shape_note,
            "params": param_count(req.model), "devices": req.devices,
            "device_memory_gb": req.device_memory / GB, "headroom": req.headroom,
            "usable_gb": req.usable / GB, "seq": req.seq_len, "global_batch": req.global_batch,
            "dtype": req.model.param_dtype, "tflops": req.tflops, "link_gb_s": req.link_gb_s,
            "ranking": "estimated step time = (training + recomputed FLOPs) / tflops + bytes "
                       "moved / link bandwidth; zero3_prefetch hides its in-loop all-gathers",
            "peak": "XLA:CPU compiled peak per device (argument + output + temp - alias)"}
