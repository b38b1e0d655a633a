"""What the compile-only ZeRO experiments measure, without importing JAX: the shapes and stages
`zero_memory` accepts and the setup of `zero_release`, so a launcher checks its flags (and
answers `--help`) before any JAX code is imported. experiments/zero/evidence.py measures them.
"""

from __future__ import annotations

import dataclasses

from experiments.cli.config import ConfigError
from model.config import ModelConfig

PAPER_PSI = {"7.5b": 7.5e9, "7.5b-gqa": 7.5e9, "128b": 128e9, "1t": 1e12}

# Shapes without a paper row: their Table-1 figure is the paper's formula at their own Psi.
OTHER_MEMORY_PRESETS = ("smollm2",)

STAGES = ("dp", "zero1", "zero2", "zero3")

# The release check's control: zero3 whose backward pass keeps every gathered layer.
KEEP_GATHERED = "zero3_keep_gathered"
RELEASE_STRATEGIES = ("zero3", "zero3_prefetch", "zero3_auto")
# Runnable presets users train under zero3 (smollm2 by default; README and docs/training.md run
# small and tiny with --strategy zero3): their zero3 step is read as shipped, at the 8 devices
# those commands use.
SHIPPED_ZERO3_PRESETS = ("tiny", "small", "smollm2")
SHIPPED_DEVICES = 8


def check_device_counts(counts) -> None:
    """Every device count a positive integer (ConfigError naming `devices` otherwise)."""
    if not counts or any(n < 1 for n in counts):
        raise ConfigError(f"devices={' '.join(map(str, counts))}: each must be a positive "
                          f"integer")


@dataclasses.dataclass(frozen=True)
class ReleaseSetup:
    d_model: int = 1024
    n_heads: int = 8
    d_ff: int = 4096
    depths: tuple[int, int] = (4, 12)
    # The second is the headline device count. Far apart, so that the part of the per-layer
    # growth that shrinks with N_d and the part that does not are told apart by the fit.
    devices: tuple[int, int] = (8, 32)
    seq_len: int = 128
    seqs_per_device: int = 4

    def validate(self) -> None:
        """Raise ConfigError naming the field: the report divides by the difference of the two
        depths and of the two device counts, so each pair must hold two different values; each
        device count must split d_model (the dimension every parameter is sharded on)."""
        for name in ("depths", "devices"):
            a, b = getattr(self, name)
            if a < 1 or b < 1 or a == b:
                raise ConfigError(f"{name}={a} {b}: must be two different positive integers")
        for n in self.devices:
            if self.d_model % n:
                raise ConfigError(f"devices={' '.join(map(str, self.devices))}: {n} does not "
                                  f"divide d_model={self.d_model} (every parameter is sharded "
                                  f"on it); give device counts that divide it")
        if self.seq_len < 1:
            raise ConfigError(f"seq_len={self.seq_len}: must be a positive integer")
        if self.seqs_per_device < 1:
            raise ConfigError(f"seqs_per_device={self.seqs_per_device}: must be a positive "
                              f"integer")
        try:
            self.model(max(self.depths)).validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def model(self, n_layers: int) -> ModelConfig:
        return ModelConfig(d_model=self.d_model, n_layers=n_layers, n_heads=self.n_heads,
                           d_ff=self.d_ff, max_len=self.seq_len, param_dtype="bfloat16",
                           compute_dtype="bfloat16", remat="full")

    @property
    def carry_bytes(self) -> int:
        """The activation the layer scan saves per layer under remat=full (bf16)."""
        return self.seqs_per_device * self.seq_len * self.d_model * 2
