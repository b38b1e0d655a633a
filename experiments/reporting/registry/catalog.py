"""Every experiment that feeds a README table or plot, in the order the runner runs them, and
the selection `--only` makes.

The entries live by area (training, zero, quant, pretrained, speed); ORDER says when each runs.
"""

from __future__ import annotations

from experiments.reporting.registry import gemma3, pretrained, quant, speed, training, zero
from experiments.reporting.registry.experiment import Experiment

# The main job's checkpoint feeds the int8 table, so main_job comes before quant_table; every
# experiment comes after those named in its `after`.
ORDER = (
    "main_job", "equivalence", "zero_memory", "comm_volume", "zero_release", "bench_strategies",
    "zero_table2", "plan", "plan_accuracy", "quant_table", "train_medium_disk",
    "quant_disk_medium", "llm_quant_table", "chat_replies", "parity_smollm2",
    "llm_int8_checkpoint", "w8a8_crosscheck", "embed_fidelity", "bench_int8", "bench_encoder",
    "encoder_ablations", "bench_decode", "shape_tokenizer", "shape_models",
    "bench_decode_llama_1b", "bench_train", "bench_train_1dev", "train_changes",
    "train_changes_8dev", "comm_volume_smollm2", "zero_memory_llama", "finetune_smollm2",
    "finetune_gemma3", "smollm2_embed_int8", "smollm2_offgrid_embed_int8",
    "smollm2_ft_embed_int8",
    "smollm2_quant_window128", "smollm2_ft_quant",
    "equivalence_smollm2", "export_train", "export_safetensors", "export_gguf",
    "export_reference", "export_parity", "bench_gpu", "bench_gpu_no_triton", "fault_injection",
    "parity_gemma3", "gemma3_quant", "gemma3_embed_int8", "llama_cpp_int8",
)


def _in_order() -> tuple[Experiment, ...]:
    by_name: dict[str, Experiment] = {}
    for area in (training, zero, quant, pretrained, speed, gemma3):
        for e in area.EXPERIMENTS:
            if e.name in by_name:
                raise ValueError(f"two experiments are named {e.name}")
            by_name[e.name] = e
    if sorted(by_name) != sorted(ORDER):
        raise ValueError(f"ORDER and the experiments differ: {set(by_name) ^ set(ORDER)}")
    return tuple(by_name[name] for name in ORDER)


EXPERIMENTS = _in_order()
NAMES = ORDER


def select(names: list[str] | None) -> list[Experiment]:
    """The experiments named and those they run after, in EXPERIMENTS' order; all when None;
    ValueError naming the unknown ones."""
    if not names:
        return list(EXPERIMENTS)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"only={' '.join(unknown)}: allowed {', '.join(NAMES)}")
    by_name = {e.name: e for e in EXPERIMENTS}
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(by_name[name].after)
    return [e for e in EXPERIMENTS if e.name in wanted]
