"""A sweep's finished repetitions kept on disk, so that a sweep stopped by a time limit (a GPU
machine's call, a SLURM job's `runtime`) resumes at the first repetition it had not finished
instead of from the start. A repetition is one pass over every configuration, so the
interleaving is kept: the next process runs the repetitions that are left, in the order the
first one would have. What differs is the slots' contents at the first resumed repetition: the
warm-up's, where a sweep that was not stopped has the previous repetition's.

The file is scratch, never a result: it lives under the resources folder, is read only by a sweep
whose key (its arguments, the code's commit, the engine's source and the model's digest) is the
same, and is removed once the sweep's results are made. The records say how many of their
repetitions an earlier process measured (`repeats_resumed`)."""

import json
import os
from pathlib import Path

from engine.config import resources_dir


def scratch_for(output: str) -> Path:
    """Where the job writing `output` keeps its finished repetitions: one file per output."""
    return resources_dir() / "partial" / (output.replace("/", "__") + ".json")


class Repetitions:
    """The repetitions a sweep has finished: `load()` those an earlier process of the same sweep
    saved, `save(reps)` after each one, `clear()` once the sweep's results are made. A repetition is a
    dict from a configuration's name (any JSON value: the sweep's tuples) to its totals."""

    def __init__(self, path, key: dict, say=None):
        self.path = Path(path)
        self.key = json.loads(json.dumps(key))  # as it reads back: tuples become lists
        self.say = say or (lambda msg: None)
        self.loaded = 0  # how many repetitions load() found

    @staticmethod
    def _name(config) -> str:
        return json.dumps(config)

    def load(self, configs) -> list[dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            self.say(f"checkpoint {self.path} unreadable ({e}); starting afresh")
            return []
        if data.get("key") != self.key:
            self.say(f"checkpoint {self.path} is of another sweep (its arguments, code or model); starting afresh")
            return []
        names = [self._name(c) for c in configs]
        reps = data.get("repetitions", [])
        if not all(isinstance(r, dict) and all(n in r for n in names) for r in reps):
            self.say(f"checkpoint {self.path} lacks configurations of this sweep; starting afresh")
            return []
        self.say(f"checkpoint {self.path}: {len(reps)} repetitions already measured, resuming")
        self.loaded = len(reps)
        return [{c: r[self._name(c)] for c in configs} for r in reps]

    def save(self, reps: list[dict]):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = {"key": self.key, "repetitions": [{self._name(c): acc for c, acc in r.items()} for r in reps]}
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)  # a process killed while writing leaves the last whole file

    def clear(self):
        self.path.unlink(missing_ok=True)
