"""Developer and user tools, the top floor (each a `python -m kvlab.tools.<name>` command, none called by a rule):
`progress` (a running or stopped run's state), `compare_runs` (two runs' rows), `profile_eval` and `bench_eval` (one
evaluation job profiled and timed), `kernel_anatomy` (the decode kernel compiled and counted without a GPU),
`gpu_check` (the GPU device check's stages, gpu/check.sh) and `full_shape` (the `full` preset's shape on the CPU)."""
