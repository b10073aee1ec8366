# Speed measurements that are not task scores: decode throughput per method, and the engine vs kvpress's
# pipeline on the same grid. Both write one Parquet file per job.


rule throughput:
    input:
        model_dir="resources/models/{model}",
        calibration=calibration_inputs,
    output:
        rows="results/speed/throughput/{model}/{ctx}.parquet",
    params:
        new_tokens=config["throughput"]["new_tokens"],
        run=lambda w: run_params(),
    log:
        "logs/throughput/{model}/{ctx}.log",
    benchmark:
        "results/benchmarks/throughput/{model}/{ctx}.tsv"
    threads: config["threads"]
    resources:
        mem_mb=8000,
        runtime=60,
        gpu=GPUS,
    conda:
        "../envs/model.yaml"
    script:
        "../workflow/throughput.py"


rule engine_vs_pipeline:
    input:
        model_dir="resources/models/{model}",
        calibration=calibration_inputs,
    output:
        rows="results/speed/engine_vs_pipeline/{model}/{ctx}.parquet",
    params:
        bench=config["benchmark"],
        task=config["tasks"][config["benchmark"]["task"]],
        run=lambda w: run_params(config["benchmark"]["task"]),
    log:
        "logs/engine_vs_pipeline/{model}/{ctx}.log",
    benchmark:
        "results/benchmarks/engine_vs_pipeline/{model}/{ctx}.tsv"
    threads: config["threads"]
    resources:
        mem_mb=8000,
        runtime=60,
        gpu=GPUS,
    conda:
        "../envs/model.yaml"
    script:
        "../workflow/engine_vs_pipeline.py"
