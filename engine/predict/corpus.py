"""The one text corpus every embedded model, its training and the prompt sets are made from: text
that ships with Python, so nothing is downloaded. Two sources, each a sorted list of
(source name, text):

- `pydoc_topics()`: the topics of the interactive help (`pydoc_data.topics`), prose;
- `stdlib_sources()`: the standard library's top-level modules, code.

A source's name is how the prompt sets name where a prompt came from, so that training can leave
out every source an evaluation prompt was cut from (engine.models.train.corpus)."""

import sysconfig
from pathlib import Path
from pydoc_data import topics


def topic_name(key: str) -> str:
    return f"pydoc_data.topics[{key!r}]"


def module_name(stem: str) -> str:
    return f"Lib/{stem}.py"


def pydoc_topics() -> list:
    """(name, text) of every help topic, in key order."""
    return [(topic_name(k), topics.topics[k]) for k in sorted(topics.topics)]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources() -> list:
    """(name, path) of every top-level module of the standard library, in path order (read on
    demand: training reads only as many as it needs)."""
    return [(module_name(p.stem), p) for p in sorted(stdlib_dir().glob("*.py"))]
