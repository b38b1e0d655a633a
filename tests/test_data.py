"""Data: deterministic file split, packing, seeded order, exact resume, per-process slices."""

import re

import numpy as np
import pytest

from experiments.training.data import (
    SequenceSampler,
    bos_of,
    default_corpus_root,
    fit_advice,
    is_validation,
    list_files,
    load_corpus,
    pack,
    split_sizes,
    validation_batches,
)


def test_default_corpus_is_the_stdlib_split_by_file():
    files = list_files(default_corpus_root())
    assert len(files) > 500
    rel = [str(f.relative_to(default_corpus_root())) for f in files]
    val = [r for r in rel if is_validation(r, 5)]
    assert 0.02 < len(val) / len(rel) < 0.09  # about 5% of the files, chosen by path hash
    assert [r for r in rel if is_validation(r, 5)] == val  # deterministic
    train, valid = load_corpus(None)
    assert train.dtype == np.uint8 and len(train) > 10 * len(valid) > 0


def test_pack_rows_are_contiguous_slices():
    stream = np.arange(100, dtype=np.uint8)
    rows = pack(stream, 9)
    assert rows.shape == (11, 10)
    np.testing.assert_array_equal(rows[1], np.arange(9, 19))
    with pytest.raises(ValueError, match="seq_len=200"):
        pack(stream, 200)


def test_sampler_is_seeded_and_resumes_exactly():
    rows = np.arange(50)[:, None].repeat(3, axis=1)
    a = SequenceSampler(rows, seed=7)
    first = [a.next_batch(8) for _ in range(9)]  # crosses an epoch boundary (50 rows)
    b = SequenceSampler(rows, seed=7)
    for _ in range(4):
        b.next_batch(8)
    resumed = SequenceSampler(rows, seed=7, position=b.position)
    for i in range(4, 9):
        np.testing.assert_array_equal(resumed.next_batch(8), first[i])
    epoch0 = np.concatenate(first)[:50, 0]
    assert sorted(epoch0.tolist()) == list(range(50))  # each row once per epoch
    other = SequenceSampler(rows, seed=8).next_batch(8)
    assert not np.array_equal(other, first[0])


def test_process_slices_assemble_the_global_batch():
    rows = np.arange(40)[:, None]
    whole = SequenceSampler(rows, seed=1).next_batch(8)
    parts = [SequenceSampler(rows, seed=1).next_batch(8, p, 4) for p in range(4)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_user_file_and_folder(tmp_path):
    text = ("hello world, " * 500).encode()
    f = tmp_path / "a.txt"
    f.write_bytes(text)
    train, val = load_corpus(str(f))
    assert len(train) + len(val) == len(text)
    with pytest.raises(ValueError, match="no such file"):
        load_corpus(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no text"):
        load_corpus(str(empty))
    # Two files, both hashed to the training side at 5%: the line says what to change.
    few = tmp_path / "few"
    few.mkdir()
    for name in ("a.txt", "b.txt"):
        (few / name).write_bytes(text)
    assert not any(is_validation(name, 5) for name in ("a.txt", "b.txt"))
    with pytest.raises(ValueError,
                       match=r"files found: 2, 5% to validation\); --val-percent \d+ puts"):
        load_corpus(str(few), val_percent=5)


def test_validation_batches_are_fixed_and_spread():
    rows = np.arange(100)[:, None]
    batches = validation_batches(rows, 10, 3)
    assert len(batches) == 3
    assert batches[-1].max() > 50  # spread over the split, not just its first files
    with pytest.raises(ValueError, match="batch_size=200"):
        validation_batches(rows, 200, 1)


def test_a_folder_that_does_not_split_says_what_would(tmp_path):
    """One file in a folder never splits by file: the line says to give the file itself; two
    files: the line names a val_percent that does put one on each side, checked here."""
    text = ("hello world, " * 500).encode()
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.txt").write_bytes(text)
    with pytest.raises(ValueError, match=r"files found: 1, .* give the file itself \(--data "):
        load_corpus(str(one))
    few = tmp_path / "few"
    few.mkdir()
    for name in ("a.txt", "b.txt"):
        (few / name).write_bytes(text)
    with pytest.raises(ValueError, match=r"--val-percent (\d+) puts files on both sides") as e:
        load_corpus(str(few), val_percent=5)
    vp = int(re.search(r"--val-percent (\d+)", str(e.value)).group(1))
    train, val = load_corpus(str(few), val_percent=vp)
    assert len(train) and len(val)


def test_fit_advice_is_computed_from_the_data(tmp_path):
    """A validation split smaller than one batch: a batch size that fits it over the devices,
    and a val_percent that holds out enough text for one batch."""
    f = tmp_path / "small.txt"
    f.write_bytes(b"x" * 20_000)
    advice = fit_advice(str(f), val_rows=7, micro_batch=8, micro_steps=1, n_dev=4, seq_len=128,
                        tokens_per_byte=0.25)
    assert "--batch-size 4 " in advice
    vp = int(re.search(r"--val-percent (\d+)", advice).group(1))
    assert split_sizes(f)[vp][1] * 0.25 >= 8 * 128 + 1 > split_sizes(f)[vp - 1][1] * 0.25
    # Too few sequences for even one per device, and no split that holds out enough.
    assert fit_advice(str(f), 1, 8, 1, 8, 4096, 1.0) == "more text, or a shorter --max-len"


def test_rows_of_a_tokenizer_with_bos_each_start_with_it():
    """A tokenizer that starts every text with BOS (Gemma's): each row is BOS, then the next
    seq_len tokens of the stream (its own leading BOS not repeated), so no stream token is lost
    or doubled; without BOS the rows are the stream's windows as before."""
    bos, seq_len = 2, 4
    stream = np.array([bos, *range(10, 23)], np.int32)  # 1 + 13 tokens
    rows = pack(stream, seq_len, bos)
    assert rows.shape == (3, seq_len + 1) and (rows[:, 0] == bos).all()
    np.testing.assert_array_equal(rows[:, 1:].ravel(), np.arange(10, 22))
    plain = pack(stream, seq_len)
    np.testing.assert_array_equal(plain[0], stream[:seq_len + 1])
    assert bos_of(None) is None
    assert bos_of(type("T", (), {"bos": []})()) is None
    assert bos_of(type("T", (), {"bos": [bos]})()) == bos
