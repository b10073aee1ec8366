rule evaluate:
    input:
        model_dir="resources/models/{model}",
    output:
        rows="results/eval/{model}/{task}/{ctx}.parquet",
    params:
        task=lambda w: config["tasks"][w.task],
        run=lambda w: {
            "methods": config["methods"],
            "budgets": config["budgets"],
            "question_modes": config["question_modes"],
            "max_new_tokens": config["max_new_tokens"],
            "dtype": config["dtype"],
            "device": config["device"],
        },
    log:
        "logs/evaluate/{model}/{task}/{ctx}.log",
    benchmark:
        "results/benchmarks/evaluate/{model}/{task}/{ctx}.tsv"
    threads: config["threads"]
    resources:
        mem_mb=8000,
        runtime=120,
    conda:
        "../envs/kvlab.yaml"
    script:
        "../workflow/evaluate.py"
