rule evaluate:
    input:
        model_dir="resources/models/{model}",
        calibration=calibration_inputs,
    output:
        rows="results/eval/{model}/{task}/{ctx}.parquet",
    params:
        task=lambda w: config["tasks"][w.task],
        run=lambda w: run_params(w.task),
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
