"""Statistics, below the report and the run state that decide from them: `anytime` (betting confidence sequences,
e-values, e-BH: bounds valid however a job stopped drawing samples) and `intervals` (the intervals and the
three-outcome decision behind every verdict, from per-sample rows). numpy, pandas and scipy only: nothing of kvlab
but each other."""
