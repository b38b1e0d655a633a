"""The English texts a pretrained LM's perplexity is read on, from what every Python install
ships (no download):

- `pydoc` (the default): the validation topics of `pydoc_data`
(`experiments/training/pydoc_corpus.py`),
  the text the int8 tables are measured on;
- `docstrings`: the docstrings of a fixed list of standard-library modules and of the public
  classes and functions each defines, in name order. A second text of another kind (API
  reference prose rather than the language reference), never used for calibration or tuning,
  to see whether a mode's figure on the first one carries over. It depends on the Python
  version's docstrings, so a results file records that version.
"""

from __future__ import annotations

import importlib
import inspect
import warnings

from experiments.cli.config import ConfigError
from experiments.training import pydoc_corpus

CORPORA = ("pydoc", "docstrings")
DOCSTRING_MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools",
    "heapq", "http.client", "itertools", "json", "logging", "os", "pathlib", "pickle", "random",
    "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
    "textwrap", "threading", "typing", "unittest", "urllib.parse", "zipfile")


def check_corpus(corpus: str) -> None:
    if corpus not in CORPORA:
        raise ConfigError(f"corpus={corpus!r}: allowed {', '.join(CORPORA)}")


def docstrings() -> str:
    parts = []
    with warnings.catch_warnings():  # typing's deprecated submodule aliases warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in DOCSTRING_MODULES:
            module = importlib.import_module(name)
            if module.__doc__:
                parts.append(module.__doc__.strip())
            for attr in sorted(dir(module)):
                obj = getattr(module, attr, None)
                if (not attr.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                        and getattr(obj, "__module__", None) == module.__name__ and obj.__doc__):
                    parts.append(obj.__doc__.strip())
    return "\n\n".join(parts)


def text(corpus: str = "pydoc") -> str:
    check_corpus(corpus)
    return pydoc_corpus.split_text("validation") if corpus == "pydoc" else docstrings()
