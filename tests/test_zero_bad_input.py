"""Bad input to the ZeRO launchers (comm_volume, zero_table2, plan_accuracy, plan): one line
naming the field, exit status 2, nothing written, and refused before anything is compiled (before
JAX is imported, for the launchers whose checks need no model arithmetic)."""

from __future__ import annotations

from tests.helpers import launch_in_one_process


def test_bad_flags_are_refused_before_compiling(tmp_path):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    out = str(tmp_path / "out.json")
    cache = str(tmp_path / "cache")
    # (module, argv, the line's start, JAX may be imported). One process runs them in order, so
    # "JAX imported" holds from the first case that imports it: plan, which does, comes last.
    cases = [
        ("experiments.comm_volume", ["--preset", "huge", "--out", out], "preset='huge': allowed",
         False),
        ("experiments.comm_volume", ["--n-layers", "-1", "--out", out],
         "n-layers=-1: must be a positive integer", False),
        ("experiments.comm_volume", ["--n-layers", "0", "--out", out],
         "n-layers=0: must be a positive integer", False),
        ("experiments.comm_volume", ["--out", str(folder)], "out=", False),
        ("experiments.zero_table2", ["--out", str(folder), "--cache", cache], "out=", False),
        ("experiments.plan_accuracy", ["--out", str(folder)], "out=", False),
        ("experiments.plan", ["--preset", "tiny", "--out", str(folder), "--cache", cache],
         "out=", True),
    ]
    rows = launch_in_one_process([(m, argv) for m, argv, _, _ in cases], timeout=120)
    for (module, argv, start, may_import_jax), row in zip(cases, rows, strict=True):
        lines = row["stderr"].strip().splitlines()
        assert row["status"] == 2, (module, argv, row)
        assert len(lines) == 1, (module, argv, row["stderr"])
        assert lines[0].startswith(f"{module}: error: {start}"), (module, argv, lines[0])
        if "--out" in argv and argv[argv.index("--out") + 1] == str(folder):
            assert "is a folder" in lines[0], lines[0]
        assert may_import_jax or not row["jax_imported"], (module, argv)
    assert not (tmp_path / "out.json").exists()
    assert not (tmp_path / "cache").exists()
    assert list(folder.iterdir()) == []
