"""Real English text every Python install ships: the documentation topics of `pydoc_data`.

`pydoc_data/topics.py` holds the language reference's topics: prose with code. They are split
into train and validation by a hash of the topic name, as the byte corpus is split by file
(`experiments/training/data.py`), so the split does not depend on the Python version's topic
order: perplexity evaluates the validation topics, fine-tuning trains on the others.
"""

from __future__ import annotations

import zlib
from pydoc_data import topics as pydoc_topics

VAL_PERCENT = 20
SEPARATOR = "\n\n"


def topics() -> dict[str, str]:
    return dict(sorted(pydoc_topics.topics.items()))


def is_validation(name: str, val_percent: int = VAL_PERCENT) -> bool:
    return zlib.crc32(name.encode()) % 100 < val_percent


def split_names(split: str, val_percent: int = VAL_PERCENT) -> list[str]:
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r}: allowed train, validation")
    want = split == "validation"
    return [n for n in topics() if is_validation(n, val_percent) == want]


def split_text(split: str, val_percent: int = VAL_PERCENT) -> str:
    """The split's topics in name order, joined by a blank line."""
    table = topics()
    return SEPARATOR.join(table[n].strip() for n in split_names(split, val_percent))
