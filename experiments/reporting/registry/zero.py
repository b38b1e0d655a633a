"""Experiments of ZeRO's claims and the planner: Table 1 (model state per device), the
communication volume, layer release, Table 2 by search, and the planner's example and accuracy."""

from __future__ import annotations

from experiments.reporting.registry.claims import holds
from experiments.reporting.registry.experiment import Experiment, launcher

EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(
        name="zero_memory",
        argv=launcher("zero_memory", "--json", "--out", "{results}/zero_memory.json"),
        quick_argv=launcher("zero_memory", "--json", "--presets", "7.5b", "--devices", "4", "64",
                            "--stages", "dp", "zero3", "--out", "{results}/zero_memory.json"),
        outputs=("zero_memory.json",),
        expected_s=330, quick_expected_s=35,
        feeds="ZeRO Table 1",
        claim=holds(
            "zero_memory.json", "every cell is within 2% of the paper",
            lambda d: d["all_within_2pct"] is True),
    ),
    Experiment(
        name="zero_memory_llama",
        argv=launcher("zero_memory", "--presets", "7.5b-gqa", "smollm2", "--json",
                      "--out", "{results}/zero_memory_llama.json"),
        quick_argv=launcher("zero_memory", "--presets", "7.5b-gqa", "--devices", "64",
                            "--stages", "zero3", "--json",
                            "--out", "{results}/zero_memory_llama.json"),
        outputs=("zero_memory_llama.json",),
        expected_s=600, quick_expected_s=20,
        feeds="Table 1 on the GQA shapes",
        claim=holds(
            "zero_memory_llama.json", "every cell within 2% of Table 1",
            lambda d: d["all_within_2pct"] is True),
    ),
    Experiment(
        name="comm_volume",
        argv=launcher("comm_volume", "--json", "--out", "{results}/comm_volume.json"),
        quick_argv=launcher("comm_volume", "--json", "--strategies", "dp", "zero3",
                            "--out", "{results}/comm_volume.json"),
        outputs=("comm_volume.json",),
        expected_s=90, quick_expected_s=30,
        feeds="communication volume table",
        # zero3_auto is XLA's own choice (it all-reduces activations): no paper figure to meet.
        claim=holds(
            "comm_volume.json", "every written strategy's volume is within 5% of the paper's",
            lambda d: all(r["within_5pct"] for r in d["results"] if r["strategy"] != "zero3_auto")),
    ),
    Experiment(
        name="comm_volume_smollm2",
        argv=launcher("comm_volume", "--preset", "smollm2", "--n-layers", "30",
                      "--strategies", "dp", "zero1", "zero2", "zero3", "zero3_prefetch", "--json",
                      "--out", "{results}/comm_volume_smollm2.json"),
        quick_argv=launcher("comm_volume", "--preset", "smollm2", "--n-layers", "4",
                            "--strategies", "zero3", "--json",
                            "--out", "{results}/comm_volume_smollm2.json"),
        outputs=("comm_volume_smollm2.json",),
        expected_s=150, quick_expected_s=30,
        feeds="ZeRO volume on the GQA model",
        claim=holds(
            "comm_volume_smollm2.json", "zero3 moves 3 Psi_layers inside the layer loop and its "
            "total is 3 Psi_layers + 2 Psi_rest",
            lambda d: all(r["within_5pct"] for r in d["results"]) and all(
                abs(r["in_layer_loop_psi_layers"] - 3) <= 0.01 for r in d["results"]
                if r["strategy"] == "zero3")),
    ),
    Experiment(
        name="zero_release",
        argv=launcher("zero_release", "--json", "--out", "{results}/zero_release.json"),
        quick_argv=launcher("zero_release", "--json", "--strategies", "zero3", "--d-model", "256",
                            "--n-heads", "4", "--d-ff", "1024",
                            "--out", "{results}/zero_release.json"),
        outputs=("zero_release.json",),
        expected_s=150, quick_expected_s=30,
        feeds="release table",
        claim=holds(
            "zero_release.json",
            "zero3 and zero3_prefetch release every gathered layer; the control that keeps "
            "them does not; so does every preset as shipped whose layers run in a loop "
            "(scan_unroll 1)",
            lambda d: all(r["released"] for r in d["results"]
                          if r["strategy"] in ("zero3", "zero3_prefetch"))
            and d["controls"] and not any(r["released"] for r in d["controls"])
            and all(r["released"] for r in d.get("shipped", [])
                    if r["model"]["scan_unroll"] == 1)),
    ),
    Experiment(
        name="zero_table2",
        argv=launcher("zero_table2", "--json", "--no-cache", "--out", "{results}/zero_table2.json"),
        quick_argv=launcher("zero_table2", "--json", "--quick", "--no-cache",
                            "--out", "{results}/zero_table2.json"),
        outputs=("zero_table2.json", "zero_table2.png"),
        expected_s=360, quick_expected_s=60,
        feeds="ZeRO Table 2 by search, planning table and plot",
        claim=holds(
            "zero_table2.json", "each stage trains a larger model than the one before",
            lambda d: [r["state_psi"] for r in d["table2"]]
            == sorted({r["state_psi"] for r in d["table2"]})),
    ),
    Experiment(
        name="plan",
        argv=launcher("plan", "--preset", "7.5b", "--devices", "64", "--device-memory", "32GB",
                      "--no-cache", "--json", "--out", "{results}/plan_7.5b_64x32gb.json"),
        quick_argv=launcher("plan", "--preset", "tiny", "--devices", "8", "--device-memory", "4MB",
                            "--seq", "32", "--global-batch", "16", "--strategies", "zero3",
                            "--remats", "full", "--data-sizes", "1", "--micro-batches", "1",
                            "--no-cache", "--json", "--out", "{results}/plan_7.5b_64x32gb.json"),
        outputs=("plan_7.5b_64x32gb.json",),
        expected_s=70, quick_expected_s=10,
        feeds="planner example table",
        claim=holds(
            "plan_7.5b_64x32gb.json", "the recommended candidate fits",
            lambda d: d["recommended"]["fits"] is True),
    ),
    Experiment(
        name="plan_accuracy",
        argv=launcher("plan_accuracy", "--json", "--out", "{results}/plan_accuracy.json"),
        quick_argv=launcher("plan_accuracy", "--json", "--quick",
                            "--out", "{results}/plan_accuracy.json"),
        outputs=("plan_accuracy.json",),
        expected_s=300, quick_expected_s=45,
        feeds="planner accuracy table",
        # The runtime's own few MB per device are a larger share of the quick run's small
        # configurations, so only the full grid is held to the 10% goal.
        claim=holds(
            # The executed program's peak and the planner's differ by a few KB, a larger share of
            # the quick grid's small peaks than of the full grid's: 0.5% holds on both.
            "plan_accuracy.json", "every configuration ran and its executable compiles to the "
            "planner's peak (within 0.5%)",
            lambda d: not d["failures"] and d["max_abs_executable_vs_planner"] <= 5e-3,
            # What planning.md says: the planner's peak is within 10% of the executed one, or below
            # it by the few MB per device a step takes outside XLA's accounting, which on the
            # smallest configurations can pass 10% (the goal is then missed, and the table says
            # so); and XLA's own buffers at the peak (glibc's blocks of 128 KiB or more) are within
            # 5% of the compiled peak. That count is read in a second step, sampled more slowly
            # than the resident set, so it can fall short of a short peak, and blocks that size
            # which are not XLA's count too: hence a bound both ways. The quick grid's small shapes
            # put more buffers under 128 KiB, so this is not held there.
            full_only=("the planner's peak is within 10%, or within 6 MB per device below, of the "
                       "executed one, and XLA's buffers at the peak within 5% of the compiled one",
                       lambda d: all((abs(r["error"]) <= 0.10 or 0 <= r["executed_peak_bytes"]
                                      - r["planner_peak_bytes"] <= 6e6)
                                     and -0.05 <= r.get("executed_large_blocks_peak_bytes",
                                                        r["compiled_peak_bytes"])
                                     / r["compiled_peak_bytes"] - 1 <= 0.05
                                     for r in d["results"]))),
    ),
)
