rule acquire_model:
    output:
        model_dir=directory("resources/models/{model}"),
    params:
        spec=lambda w: {k: v for k, v in config["models"][w.model].items() if k != "evaluate"},  # what is acquired
    log:
        "logs/acquire_model/{model}.log",
    benchmark:
        "results/benchmarks/acquire_model/{model}.tsv"
    threads: 2
    resources:
        mem_mb=8000,
        runtime=30,
    conda:
        "../envs/model.yaml"
    script:
        "../workflow/acquire_model.py"
