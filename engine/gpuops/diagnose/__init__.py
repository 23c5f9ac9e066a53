"""Graded diagnostics: what the real tools print, read into typed checks, and what each
GPU SKU is expected to reach.

- `results`: `Check` (one measured or judged item) and `GradeResult` (a grade's checks,
  its verdict and a one-line summary naming the first failure);
- `parsers`: `dcgmi diag -j`, nccl-tests' `all_reduce_perf`, `nvbandwidth` and perftest's
  `ib_write_bw` output read into checks; output that is not what the tool prints raises
  `DiagnosticsError`;
- `skus`: the per-SKU expectations (`skus.yml`, each number with its public sources) and
  a site's file merged over them.

The grades (1 quick, 2 medium, 3 deep, 4 fabric) and which tool runs in which are the
playbooks' business; this folder only reads what those tools printed.

May import: nothing.
"""
