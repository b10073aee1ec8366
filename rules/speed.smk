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
        batches=config["throughput"]["batches"],
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
        task=config["tasks"].get(config["benchmark"]["task"]),  # a niah task (checked) when speed_benchmarks runs this rule
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


# The decode-attention kernel over packed codes against SDPA on the dense cache; in the DAG only with
# `device: cuda` (on a CPU, Triton only interprets: nothing to time).
rule decode_kernels:
    input:
        model_dir="resources/models/{model}",
    output:
        rows="results/speed/decode_kernels/{model}.parquet",
    params:
        spec=config["decode_kernels"],
        run={key: config[key] for key in ("dtype", "device")},
    log:
        "logs/decode_kernels/{model}.log",
    benchmark:
        "results/benchmarks/decode_kernels/{model}.tsv"
    threads: config["threads"]
    resources:
        mem_mb=16000,
        runtime=60,
        gpu=GPUS,
    conda:
        "../envs/model.yaml"
    script:
        "../workflow/decode_kernels.py"
