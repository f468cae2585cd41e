"""The workflow's table and figure layer, importable from the installed package: aggregation of
the raw records into tables (`aggregate`), the claims table (`claims`), the figures (`plotting`),
the README's and docs' generated blocks (`docblocks`), two runs' verdicts side by side
(`compare_runs`, `claims_check`), and what a rule's script shares (`jobs`). The workflow's
`script:` files are thin entries into these."""
