rule cost_table:
    input:
        model_dirs=model_dirs(),
    output:
        costs="results/accounting/costs.parquet",
    params:
        context_tokens=config["report"]["cost_context_tokens"],
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
