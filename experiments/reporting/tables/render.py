"""Which table fills which marked section of README.md and docs/*.md, and the rendering.

Each table sits between `<!-- report:NAME -->` and `<!-- /report:NAME -->`; a table whose
results file does not exist yet says so instead of showing numbers. `python -m
experiments.report` rewrites the sections, `--check` says whether any is out of date.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from experiments.reporting.tables import (
    export_q8,
    gemma3,
    pretrained,
    quant,
    speed,
    training,
    zero,
)
from experiments.reporting.tables.common import RESULTS, SHOWN, load
from experiments.reporting.tables.headline import headline, headline_gpu

# Section name -> (its results file, the renderer of that file's JSON).
SECTIONS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "main_job": ("main_job.json", training.main_job),
    "equivalence": ("equivalence.json", training.equivalence),
    "strategy_speed": ("strategy_speed.json", training.strategy_speed),
    "zero_memory": ("zero_memory.json", zero.zero_memory),
    "zero_memory_peak": ("zero_memory.json", zero.zero_memory_peak),
    "comm_volume": ("comm_volume.json", zero.comm_volume),
    "comm_volume_smollm2": ("comm_volume_smollm2.json", zero.comm_volume_layers),
    "zero_memory_llama": ("zero_memory_llama.json", zero.zero_memory),
    "zero_release": ("zero_release.json", zero.zero_release),
    "quant_eval": ("quant_eval.json", quant.quant_eval),
    "quant_disk_medium": ("quant_disk_medium.json", quant.quant_eval),
    "int8_bench": ("int8_bench.json", quant.int8_bench),
    "embed_fidelity": ("embed_fidelity.json", pretrained.embed_fidelity),
    "bench_encoder": ("bench_encoder.json", speed.bench_encoder),
    "encoder_ablations": ("encoder_ablations.json", speed.encoder_ablations),
    "fault_injection": ("fault_injection.json", training.fault_injection),
    "smollm2_parity": ("smollm2_parity.json", pretrained.smollm2_parity),
    "smollm2_quant": ("smollm2_quant.json", pretrained.smollm2_quant),
    "smollm2_int8_checkpoint": ("smollm2_int8_checkpoint.json", pretrained.smollm2_int8_checkpoint),
    "w8a8_crosscheck": ("smollm2_w8a8_crosscheck.json", pretrained.w8a8_crosscheck),
    "chat_replies": ("smollm2_chat_replies.json", pretrained.chat_replies),
    "bench_decode": ("bench_decode.json", speed.bench_decode),
    "bench_decode_llama_1b": ("bench_decode_llama_1b.json", speed.bench_decode),
    "bench_gpu": ("bench_gpu.json", speed.bench_gpu),
    "bench_gpu_no_triton": ("bench_gpu_no_triton.json", speed.bench_gpu),
    "finetune_smollm2": ("finetune_smollm2.json", training.finetune_smollm2),
    "finetune_gemma3": ("finetune_gemma3.json", training.finetune_smollm2),
    "equivalence_smollm2": ("equivalence_smollm2.json", training.equivalence_smollm2),
    "plan_example": ("plan_7.5b_64x32gb.json", zero.plan_example),
    "plan_accuracy": ("plan_accuracy.json", zero.plan_accuracy),
    "zero_table2": ("zero_table2.json", zero.zero_table2),
    "zero_table2_planning": ("zero_table2.json", zero.zero_table2_planning),
    "train_speed": ("bench_train.json", speed.train_speed),
    "train_breakdown": ("bench_train.json", speed.train_breakdown),
    "train_changes": ("bench_train_changes.json", speed.train_changes),
    "gemma3_parity": ("gemma3_parity.json", gemma3.gemma3_parity),
    "gemma3_quant": ("gemma3_quant.json", gemma3.gemma3_quant),
    "gemma3_embed_int8": ("gemma3_embed_int8.json", pretrained.embed_int8),
    "smollm2_embed_int8": ("smollm2_embed_int8.json", pretrained.embed_int8),
    "smollm2_ft_embed_int8": ("smollm2_ft_embed_int8.json", pretrained.embed_int8),
    "smollm2_offgrid_embed_int8": ("smollm2_offgrid_embed_int8.json", pretrained.embed_int8),
    "llama_cpp_int8": ("llama_cpp_int8.json", export_q8.llama_cpp_int8),
}

# Sections whose renderer reads several results files: it gets the results folder instead.
MULTI_FILE = {"headline": headline, "headline_gpu": headline_gpu,
              "export_run": pretrained.export_run,
              "smollm2_ft_quant": pretrained.smollm2_ft_quant}


def documents(root: Path = Path(".")) -> list[Path]:
    """The markdown files whose tables `render` fills: README.md, then docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render(readme: str, results: str | Path = RESULTS) -> str:
    """`readme` with every marked table regenerated from the JSON files in `results`."""
    jobs = [(name, load(file, results), fn, file) for name, (file, fn) in SECTIONS.items()]
    jobs += [(name, Path(results), fn, "*") for name, fn in MULTI_FILE.items()]
    for name, data, fn, file in jobs:
        body = fn(data) if data else f"_(no {SHOWN}/{file} yet: run the command above)_"
        pattern = re.compile(rf"(<!-- report:{name} -->\n)(?:.*?\n)?(<!-- /report:{name} -->)",
                             re.S)
        readme = pattern.sub(lambda m, b=body: m.group(1) + b + "\n" + m.group(2), readme)
    return readme
