"""The ZeRO stages as data: what each one shards, and how its gradients are reduced.

| strategy   | params  | grads (kept)      | optimizer state | collectives                         |
|------------|---------|-------------------|-----------------|-------------------------------------|
| dp         | whole   | whole, all-reduce | whole           | all-reduce(grads)                   |
| zero1      | whole   | whole until step  | sharded         | reduce-scatter(grads), all-gather(p)|
| zero2      | whole   | sharded per micro | sharded         | reduce-scatter per micro, all-gather|
| zero3      | sharded | sharded           | sharded         | per-layer all-gather fwd+bwd, RS    |
| zero3_auto | sharded | sharded           | sharded         | left to the compiler (annotations)  |
"""

from __future__ import annotations

import dataclasses

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "zero3_auto")
# Names the experiments accept: a strategy, or zero3 with the next layer's gather issued early.
VARIANTS = (*STRATEGIES, "zero3_prefetch")


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str

    def __post_init__(self):
        if self.name not in STRATEGIES:
            raise ValueError(f"strategy={self.name!r}: allowed {', '.join(STRATEGIES)}")

    @property
    def shards_params(self) -> bool:
        return self.name in ("zero3", "zero3_auto")

    @property
    def shards_optimizer(self) -> bool:
        return self.name != "dp"

    @property
    def shards_grads(self) -> bool:
        """Gradients leave each micro-step already reduce-scattered (ZeRO-2 and up)."""
        return self.name in ("zero2", "zero3", "zero3_auto")

    @property
    def explicit(self) -> bool:
        """Collectives written by hand under shard_map (all but zero3_auto)."""
        return self.name != "zero3_auto"


def parse_variant(name: str) -> tuple[Strategy, bool]:
    """'zero3_prefetch' -> (Strategy('zero3'), True); a plain strategy -> (it, False)."""
    if name not in VARIANTS:
        raise ValueError(f"strategy={name!r}: allowed {', '.join(VARIANTS)}")
    prefetch = name == "zero3_prefetch"
    return Strategy("zero3" if prefetch else name), prefetch
