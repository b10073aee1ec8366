rule cost_table:
    input:
        model_dirs=model_dirs(),
    output:
        costs="results/accounting/costs.parquet",
        reads="results/accounting/reads.parquet",
        crossover="results/accounting/crossover.parquet",
    params:
        context_tokens=config["report"]["cost_context_tokens"],
        sparse_reads=config["report"]["sparse_reads"],
        crossover=config["report"]["crossover"],
    log:
        "logs/cost_table.log",
    localrule: True
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/report.yaml"
    script:
        "../workflow/cost_table.py"
