"""The launchers as a user runs them: exit codes, one-line errors, nothing written on bad input."""

import dataclasses
import json
import os

import pytest

from experiments.cli.config import ConfigError
from experiments.training.config import load_config
from experiments.training.restore import restore_params
from tests.helpers import cli, cli_in_one_process, launch_in_one_process, one_line_error

# Refused before JAX starts: these run in one process (tests/helpers.cli_in_one_process).
EARLY = [
    (["--preset", "huge"], ["preset='huge'", "tiny"]),
    (["--strategy", "zero4"], ["strategy='zero4'", "zero3"]),
    (["--steps", "0"], ["steps=0", "positive"]),
    (["--n-heads", "3"], ["n_heads=3", "divide d_model"]),
    (["--data", "/nonexistent/corpus"], ["data='/nonexistent/corpus'", "no such file"]),
    (["--attention", "flash"], ["attention='flash'", "xla, cudnn"]),
    (["--attention", "cudnn"], ["attention='cudnn'", "compute_dtype='bfloat16'"]),
]
# Refused once the backend has started (the device count, the backend's kind), before the run
# writes anything: one process each.
LATE = [
    (["--batch-size", "12"], ["batch_size=12", "8 devices"]),
    (["--mesh", "data=3,fsdp=3"], ["mesh='data=3,fsdp=3'", "device count 8"]),
    (["--attention", "cudnn", "--compute-dtype", "bfloat16"], ["attention='cudnn'",
                                                               "NVIDIA GPU", "backend is 'cpu'"]),
]
HELP = ["train", "evaluate", "sample"]


@pytest.fixture(scope="module")
def early(tmp_path_factory):
    """EARLY's refusals, each with its own work dir, then HELP's --help, in one process:
    ([(workdir, proc) per EARLY case], [proc per HELP launcher])."""
    root = tmp_path_factory.mktemp("early")
    workdirs = [root / f"run{i}" for i in range(len(EARLY))]
    procs = cli_in_one_process(
        [("train", ["--workdir", str(w), "--preset", "tiny", *args])
         for w, (args, _) in zip(workdirs, EARLY, strict=True)]
        + [(module, ["--help"]) for module in HELP])
    return list(zip(workdirs, procs[:len(EARLY)], strict=True)), procs[len(EARLY):]


@pytest.mark.parametrize("case", range(len(EARLY)), ids=[a[0][0] for a in EARLY])
def test_bad_input_exits_2_and_writes_nothing(early, case):
    workdir, proc = early[0][case]
    one_line_error(proc, *EARLY[case][1])
    assert not workdir.exists()


@pytest.mark.parametrize("args,fragments", LATE)
def test_bad_input_after_start_up_exits_2_and_writes_nothing(tmp_path, args, fragments):
    workdir = tmp_path / "run"
    proc = cli("train", "--workdir", str(workdir), "--preset", "tiny", *args)
    one_line_error(proc, *fragments)
    assert not workdir.exists()


def test_empty_data_folder_and_occupied_workdir(tmp_path):
    (tmp_path / "empty").mkdir()
    workdir = tmp_path / "run"
    one_line_error(cli("train", "--workdir", str(workdir), "--preset", "tiny", "--data",
                       str(tmp_path / "empty")), "holds no text")
    assert not workdir.exists()
    workdir.mkdir()
    (workdir / "config.json").write_text("{}")
    one_line_error(cli("train", "--workdir", str(workdir), "--preset", "tiny"),
                   "already holds a run", "--resume")
    assert os.listdir(workdir) == ["config.json"]


@pytest.mark.parametrize("module", HELP)
def test_help(early, module):
    proc = early[1][HELP.index(module)]
    assert proc.returncode == 0 and "--workdir" in proc.stdout


def test_train_evaluate_sample_end_to_end(tmp_path):
    workdir = tmp_path / "run"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(open(json.__file__).read() * 4)
    proc = cli("train", "--workdir", str(workdir), "--preset", "tiny", "--steps", "4",
               "--ckpt-every", "2", "--eval-every", "2", "--data", str(corpus), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"config.json", "metrics.jsonl", "checkpoints"} <= set(os.listdir(workdir))
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert all(r["tokens_per_s"] > 0 for r in rows if "loss" in r)

    # The newest checkpoint, then an older one (--step restores that one, not the newest):
    # both on 2 devices, so one process (one backend) runs both.
    newest, step2 = launch_in_one_process(
        [("experiments.evaluate", ["--workdir", str(workdir), "--json", "--devices", "2"]),
         ("experiments.evaluate", ["--workdir", str(workdir), "--json", "--devices", "2",
                                   "--step", "2"])])
    assert newest["status"] == 0 and step2["status"] == 0, newest["stderr"] + step2["stderr"]
    ev = json.loads(newest["stdout"].strip().splitlines()[-1])
    assert ev["step"] == 4 and ev["param_bytes"] == 41120 * 4
    assert ev["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    assert ev["bits_per_byte"] == pytest.approx(ev["val_loss"] / 0.6931471805599453)
    older = json.loads(step2["stdout"].strip().splitlines()[-1])
    val_at = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert older["step"] == 2 and older["val_loss"] == pytest.approx(val_at[2], rel=1e-5)
    assert older["val_loss"] != pytest.approx(val_at[4], rel=1e-5)
    with pytest.raises(ConfigError, match=r"^step=3: no such checkpoint; available: \[2, 4\]$"):
        restore_params(workdir, step=3)

    # A run trained with the fused cuDNN attention (on a GPU) restores here with XLA's.
    cfg = load_config(workdir)
    gpu_cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, attention="cudnn", compute_dtype="bfloat16"))
    restored = restore_params(workdir, gpu_cfg, devices=1)
    assert restored.cfg.model.attention == "xla"
    assert restored.cfg.model.compute_dtype == "bfloat16"
    # A config.json edited after training is named before any array is read (Orbax's failed
    # reads would otherwise print pages of tracebacks from its background threads).
    wider = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=512))
    with pytest.raises(ConfigError, match=r"^vocab_size=512: config.json does not match "
                                          r"checkpoint 4, written with vocab_size=256 "):
        restore_params(workdir, wider, devices=1)
    fewer_kv = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_kv_heads=1))
    with pytest.raises(ConfigError, match=r"^n_kv_heads=1 \(1 key/value heads\): config.json does "
                                          r"not match checkpoint 4, written with 2 key/value"):
        restore_params(workdir, fewer_kv, devices=1)
    # n_kv_heads = n_heads is the model it was trained as (None: one key/value head per head).
    same = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_kv_heads=2))
    assert restore_params(workdir, same, devices=1).step == 4

    # A byte model takes bytes that are not UTF-8 (argv hands them over as lone surrogates),
    # and the text around them comes back as typed: one launcher start for a plain prompt and
    # an invalid byte, which take the same encoding (run_tokenizer.encode_prompt).
    proc = cli("sample", "--workdir", str(workdir), "--prompt", "def \udcffe",
               "--max-new-tokens", "10", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["text"].startswith("def \ufffde")

    # --resume takes the run's own configuration (tiny preset, its corpus, 4 steps): only the
    # flags that change need giving, and one that would change the run is named.
    proc = cli("train", "--workdir", str(workdir), "--resume", "--devices", "2", "--strategy",
               "zero3", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert resumed["resumed_from"] == 4 and resumed["devices"] == 2
    assert resumed["params"] == summary["params"]
    # Refused before JAX starts, in one process: a reply past the context the run records, a
    # folder without a run, and a resume flag that would change the run.
    past, nothing, preset, lr = cli_in_one_process([
        ("sample", ["--workdir", str(workdir), "--max-new-tokens", "500"]),
        ("evaluate", ["--workdir", str(tmp_path / "nothing")]),
        ("train", ["--workdir", str(workdir), "--resume", "--preset", "small"]),
        ("train", ["--workdir", str(workdir), "--resume", "--lr", "0.5"])])
    one_line_error(past, "max_new_tokens=500", "context of 32")
    one_line_error(nothing, "no config.json")
    one_line_error(preset, "preset='small'", "'tiny'")
    one_line_error(lr, "resume: lr=0.5 differs from the run's")


def test_an_unreadable_config_is_one_line_naming_the_work_dir(tmp_path):
    """evaluate on a work dir whose config.json cannot be read: one line naming workdir, exit
    2. Root reads a chmod-000 file anyway; /proc/self/mem is a file no process reads at offset
    0, so a link to it stands in for the unreadable file there."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    config = workdir / "config.json"
    if os.geteuid() != 0:
        config.write_text("{}")
        config.chmod(0)
    elif os.path.exists("/proc/self/mem"):
        config.symlink_to("/proc/self/mem")
    else:
        pytest.skip("no way to make an unreadable file here")
    one_line_error(cli("evaluate", "--workdir", str(workdir)), f"workdir={str(workdir)!r}",
                   "config.json cannot be read")
    assert sorted(os.listdir(workdir)) == ["config.json"]


def test_fault_injection_refuses_bad_input_before_running(tmp_path):
    one_line_error(cli("fault_injection", "--scenarios", "nonfinite,nonfinite"),
                   "scenarios='nonfinite,nonfinite'", "distinct names")
    one_line_error(cli("fault_injection", "--scenarios", "nonfinite", "--out", str(tmp_path)),
                   f"out={str(tmp_path)!r}", "is a folder")
    assert os.listdir(tmp_path) == []
