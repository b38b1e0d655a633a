"""Data: deterministic file split, packing, seeded order, exact resume, per-process slices."""

import numpy as np
import pytest

from experiments.training.data import (
    SequenceSampler,
    default_corpus_root,
    is_validation,
    list_files,
    load_corpus,
    pack,
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
    with pytest.raises(ValueError, match=r"files found: 2, 5% to validation; .*--val-percent"):
        load_corpus(str(few), val_percent=5)


def test_validation_batches_are_fixed_and_spread():
    rows = np.arange(100)[:, None]
    batches = validation_batches(rows, 10, 3)
    assert len(batches) == 3
    assert batches[-1].max() > 50  # spread over the split, not just its first files
    with pytest.raises(ValueError, match="batch_size=200"):
        validation_batches(rows, 200, 1)
