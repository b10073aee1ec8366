# Calibration per model on prose the tasks never use: key/value channel statistics (pre- and post-RoPE),
# massive activations, attention sinks and concentration, and what later stages consume (FP8 scales,
# KVQuant grids, a per-layer budget profile, StreamingLLM's sink count).


rule calibrate:
    input:
        model_dir="resources/models/{model}",
    output:
        tables=expand("results/calibration/{{model}}/{table}.parquet", table=CALIBRATION_TABLES),
    params:
        spec=config["calibration"],
        run={key: config[key] for key in ("dtype", "device")},  # not the methods: editing them must not recalibrate
    log:
        "logs/calibrate/{model}.log",
    benchmark:
        "results/benchmarks/calibrate/{model}.tsv"
    threads: config["threads"]
    resources:
        mem_mb=8000,
        runtime=60,
        gpu=GPUS,
    conda:
        "../envs/model.yaml"
    script:
        "../workflow/calibrate.py"
