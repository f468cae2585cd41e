"""Prompt sets, drawn from text that ships with Python; they ship with the package
(`engine/data/prompts/`, also reachable as `configs/prompts/` in the repository).

`general`: the prose of `pydoc_data.topics` (the interactive help's topics); `code`: the
standard library's own source. Each set is split into `fit` prompts (predictors learn from
their traces) and `eval` prompts (predictors are scored on them); the two splits come from
different topics or modules, so they never share a prompt.
`write()` regenerates the files: deterministic for a Python version, and only on the one that made
the shipped files (`MADE_WITH`), since another's help topics and module layout differ (3.12's
`zipfile` is a package, not `zipfile.py`).
"""

import json
import re
import sys
from pathlib import Path

from ..config import DATA
from . import corpus

PROMPT_DIR = DATA / "prompts"
SETS = ("general", "code")
SPLITS = ("fit", "eval")
CHARS = 320
MADE_WITH = (3, 11)  # the CPython whose standard library the shipped sets were cut from
CODE_MODULES = (
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "codecs",
    "colorsys",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "html/parser",
    "imaplib",
    "inspect",
    "ipaddress",
    "json/decoder",
    "json/encoder",
    "locale",
    "logging/__init__",
    "mailbox",
    "mimetypes",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pickle",
    "pkgutil",
    "platform",
    "plistlib",
    "pprint",
    "queue",
    "quopri",
    "random",
    "re/_parser",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "shutil",
    "smtplib",
    "socketserver",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "tokenize",
    "trace",
    "traceback",
    "typing",
    "unittest/case",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "zipfile",
)


def _cut(text: str, chars=CHARS) -> str:
    """About `chars` characters, ending at a line break."""
    text = text.strip("\n")
    if len(text) <= chars:
        return text
    end = text.rfind("\n", 0, chars)
    return text[: end if end > chars // 2 else chars]


def _general():

    out = []
    for name, body in corpus.pydoc_topics():
        paras = [p for p in re.split(r"\n\s*\n", body) if len(p.strip()) > 120 and not p.startswith("   ")]
        if paras:
            out.append((name, _cut(re.sub(r"[ \t]+", " ", paras[0]).strip())))
    return out


def _code():

    lib = corpus.stdlib_dir()
    out = []
    for mod in CODE_MODULES:
        src = (lib / f"{mod}.py").read_text(encoding="utf-8")
        m = re.search(r"^(def |class )", src, re.M)
        if m:
            out.append((corpus.module_name(mod), _cut(src[m.start() :])))
    return out


def generate() -> dict:
    """{set: [prompt dicts]}: every third source goes to eval, the rest to fit."""
    if sys.version_info[:2] != MADE_WITH:
        made, here = ".".join(map(str, MADE_WITH)), ".".join(map(str, sys.version_info[:2]))
        raise ValueError(
            f"the prompt sets are cut from Python {made}'s standard library and help topics; this is "
            f"Python {here}, whose differ: make them again with Python {made}"
        )
    result = {}
    for name, items in (("general", _general()), ("code", _code())):
        rows = []
        for i, (source, text) in enumerate(items):
            split = "eval" if i % 3 == 2 else "fit"
            rows.append(dict(id=f"{name}-{i:03d}", set=name, split=split, source=source, text=text))
        result[name] = rows
    return result


def write(directory=PROMPT_DIR):
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in generate().items():
        with open(directory / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True) + "\n")


def load(name: str, split: str | None = None, directory=PROMPT_DIR) -> list:
    """The prompts of a set (and split), each a dict with id, set, split, source, text."""
    if name not in SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(SETS)}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    path = Path(directory) / f"{name}.jsonl"
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                if r["split"] not in SPLITS or not isinstance(r["text"], str):
                    raise ValueError("bad split or text")
            except (ValueError, KeyError) as e:
                raise ValueError(f"{path}: line {n}: malformed prompt ({e})") from None
            rows.append(r)
    return [r for r in rows if split is None or r["split"] == split]
