"""The plan layer, pure Python (no torch): boxes and specs, train and engine layouts, roles,
the sender assignment, transfers and buckets, the checks, ``RefitPlan`` and the cost formulas.
Built once in ``prepare()``, the same on every rank."""
