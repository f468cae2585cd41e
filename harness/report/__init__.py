"""The workflow's table and figure layer, importable from the installed package: aggregation of
the raw records into tables (`aggregate`, one module a table in `tables/`), the claims table
(`claims`), the figures (`plotting`), the README's and docs' generated blocks (`docblocks`), two
runs' verdicts side by side (`compare_runs`, `claims_check`), and what a rule's script shares
(`joblog`: its log; `jobs`: a gate's raw file). The workflow's `script:` files are thin entries
into these."""
