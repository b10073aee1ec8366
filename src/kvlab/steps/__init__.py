"""The pipeline's steps, one module per rule's work (workflow/*.py, the rules' thin scripts, call them): `evaluate`
(rule evaluate), `calibrate` (calibrate), `benchmark` (throughput, engine_vs_pipeline), `kernel_bench`
(decode_kernels), `workload_recipe` (workload), `costs` (cost_table), `collect` (collect). Above the run state, the
engine and the report; below the tools."""
