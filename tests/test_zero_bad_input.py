"""Bad input to the ZeRO launchers (comm_volume, zero_table2, plan_accuracy, plan): one line
naming the field, exit status 2, nothing written, and refused before anything is compiled (before
JAX is even imported)."""

from __future__ import annotations

from tests.helpers import launch_in_one_process


def test_bad_flags_are_refused_before_compiling(tmp_path):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    out = str(tmp_path / "out.json")
    cache = str(tmp_path / "cache")
    # (module, argv, the line's start); one process runs them all, so JAX must stay unimported.
    cases = [
        ("experiments.comm_volume", ["--preset", "huge", "--out", out], "preset='huge': allowed"),
        ("experiments.comm_volume", ["--n-layers", "-1", "--out", out],
         "n-layers=-1: must be a positive integer"),
        ("experiments.comm_volume", ["--n-layers", "0", "--out", out],
         "n-layers=0: must be a positive integer"),
        ("experiments.comm_volume", ["--out", str(folder)], "out="),
        ("experiments.zero_table2", ["--out", str(folder), "--cache", cache], "out="),
        ("experiments.plan_accuracy", ["--out", str(folder)], "out="),
        ("experiments.plan", ["--preset", "tiny", "--out", str(folder), "--cache", cache],
         "out="),
    ]
    rows = launch_in_one_process([(m, argv) for m, argv, _ in cases], timeout=120)
    for (module, argv, start), row in zip(cases, rows, strict=True):
        lines = row["stderr"].strip().splitlines()
        assert row["status"] == 2, (module, argv, row)
        assert len(lines) == 1, (module, argv, row["stderr"])
        assert lines[0].startswith(f"{module}: error: {start}"), (module, argv, lines[0])
        if "--out" in argv and argv[argv.index("--out") + 1] == str(folder):
            assert "is a folder" in lines[0], lines[0]
        assert not row["jax_imported"], (module, argv)
    assert not (tmp_path / "out.json").exists()
    assert not (tmp_path / "cache").exists()
    assert list(folder.iterdir()) == []
