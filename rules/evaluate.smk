from kvlab.state.jobs import job_mem_mb


rule workload:
    output:
        rows="results/workloads/{task}.jsonl",
    params:
        recipe=lambda w: {k: config["tasks"][w.task][key] for k, key in (("rows", "recipe_rows"), ("seed", "seed"), ("words", "recipe_words"))},
        recipe_name=lambda w: config["tasks"][w.task]["recipe"],
    log:
        "logs/workload/{task}.log",
    wildcard_constraints:
        task=RECIPE_TASKS,
    conda:
        "../envs/model.yaml"
    script:
        "../workflow/qa_workload.py"


rule evaluate:
    input:
        model_dir="resources/models/{model}",
        calibration=calibration_inputs,
        rows=dataset_rows,
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
        mem_mb=lambda w, input: job_mem_mb(config, input.model_dir, w.task, int(w.ctx)),  # by model and context (>= prose_kl's 10.2 GB at 1K)
        runtime=120,
        gpu=GPUS,
    conda:
        "../envs/model.yaml"
    script:
        "../workflow/evaluate.py"


rule serve:
    input:
        unpack(serve_inputs),
        rows=dataset_rows,
    output:
        rows="results/eval/{model}@{engine}/{task}/{ctx}.parquet",
    params:
        task=lambda w: config["tasks"][w.task],
        run=lambda w: run_params(w.task),
    log:
        "logs/serve/{model}@{engine}/{task}/{ctx}.log",
    benchmark:
        "results/benchmarks/evaluate/{model}@{engine}/{task}/{ctx}.tsv"
    wildcard_constraints:
        engine=SERVING_ENGINES,
    threads: config["threads"]
    resources:
        mem_mb=6000,  # llama.cpp: the GGUF mapped once per cache type; vLLM: one engine at a time, its 1 GiB CPU cache
        runtime=120,
        gpu=lambda w: GPUS if w.engine == "vllm" else 0,
    conda:
        "../envs/model.yaml"
    script:
        "../workflow/serve.py"
