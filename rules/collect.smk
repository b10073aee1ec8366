rule collect:
    input:
        rows=eval_rows(),
        speed=speed_rows(),
        calibration=calibration_tables(),
        model_dirs=model_dirs(),
        costs="results/accounting/costs.parquet",
        reads="results/accounting/reads.parquet",
        crossover="results/accounting/crossover.parquet",
        benchmarks=[f"results/benchmarks/evaluate/{p.removeprefix('results/eval/').removesuffix('.parquet')}.tsv" for p in eval_rows()]
        + [p.replace("results/speed/", "results/benchmarks/").replace(".parquet", ".tsv") for p in speed_rows()]
        + [f"results/benchmarks/{rule}/{m}.tsv" for rule in ("acquire_model", "calibrate") for m in MODELS],
    output:
        db="results/kvlab.duckdb",
    params:
        config=config,
    log:
        "logs/collect.log",
    localrule: True
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/report.yaml"
    script:
        "../workflow/collect.py"
