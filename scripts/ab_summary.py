#!/usr/bin/env python3
"""What an `ab_commits.sh` run of `bench prefetch --record` measured, side by side, from its raw
records: per commit, the median [min, max] over runs of each configuration's tok/s, its tok/s
over demand loading's in the same run, and its ms per token by part (the `time_split_ms`).

    scripts/ab_summary.py results/raw/bench/prefetch/FILE.jsonl ...
"""

import json
import statistics
import sys
from pathlib import Path


def summary(paths) -> dict:
    """{commit: {(configuration, figure): [value per run]}}; a record that is not a prefetch
    bench's is a named error."""
    out = {}
    for path in paths:
        with open(path) as f:
            line = f.readline()
        try:
            r = json.loads(line)
            res = r["result"]["results"]
            demand = res["none/d0"]["tok_s"]
            commit = r["commit"][:12] + ("-dirty" if r["dirty"] else "")
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"{path}: line 1 is not a `bench prefetch` raw record ({e!r})") from None
        d = out.setdefault(commit, {})
        for name, v in res.items():
            d.setdefault((name, "tok_s"), []).append(v["tok_s"])
            d.setdefault((name, "x demand"), []).append(v["tok_s"] / demand)
            for part, ms in v.get("time_split_ms", {}).items():
                d.setdefault((name, f"{part} ms"), []).append(ms)
    return out


def main(argv):
    if not argv:
        raise SystemExit(__doc__)
    for commit, d in summary([Path(p) for p in argv]).items():
        runs = len(next(iter(d.values())))
        print(f"{commit}: {runs} runs")
        for (name, fig), xs in sorted(d.items()):
            print(f"  {name:16s} {fig:12s} {statistics.median(xs):9.3f} [{min(xs):.3f}, {max(xs):.3f}]")


if __name__ == "__main__":
    main(sys.argv[1:])
