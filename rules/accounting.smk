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
    conda:
        "../envs/kvlab.yaml"
    script:
        "../workflow/cost_table.py"
