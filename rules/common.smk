# Config validation and the helpers the rules share. Logic beyond a few lines lives in the kvlab package.
import os
import re

from snakemake.exceptions import WorkflowError

from kvlab.state.config import CALIBRATION_TABLES, ConfigError, check_device, dtype_floor_note, resolve
from kvlab.state.jobs import run_params as job_params
from kvlab.methods import KINDS, build, engines, for_task, uses_calibration
from kvlab.state.runstate import drop_orphans, say
from kvlab.tasks import inputs as task_inputs

try:
    config.update(resolve(config, f"{workflow.basedir}/workflow/config.schema.yaml"))
except ConfigError as error:
    raise WorkflowError(f"kvlab {error}") from None

METHODS = build(config["methods"])  # typed once; the jobs receive these objects in their params
MODELS = list(config["models"])
SERVING_ENGINES = "|".join(k for k, kind in KINDS.items() if kind.engine is not None)  # rule serve's {engine}
EVALUATED = [m for m, spec in config["models"].items() if spec["evaluate"]]  # the rest: acquired and calibrated
TASKS = list(config["tasks"])
# dataset tasks whose file a recipe writes (rule workload); a pattern that matches nothing when there are none
RECIPE_TASKS = "|".join(re.escape(t) for t, spec in config["tasks"].items() if spec.get("recipe")) or "(?!x)x"
GPUS = int(config["device"] == "cuda")  # the rules that load the model request a GPU from the scheduler on cuda
os.environ.setdefault("KVLAB_ROOT", workflow.basedir)  # envs/*.post-deploy.sh install kvlab from this checkout


wildcard_constraints:
    model="|".join(map(re.escape, MODELS)),
    task="|".join(map(re.escape, TASKS)),
    ctx=r"\d+",


def eval_rows():
    """One Parquet file per (model, task, context length), and per serving engine of the methods (kvlab.methods.serving)
    one more under the model `<model>@<engine>` for each task some of its methods run on (rule serve)."""
    engine_tasks = {e: [t for t in config["tasks"] if any(m.kind.engine == e and m.runs_on(t) for m in METHODS.values())] for e in engines(METHODS)}
    return [f"results/eval/{model}/{task}/{ctx}.parquet" for model in EVALUATED for task, spec in config["tasks"].items() for ctx in spec["context_tokens"]] + [
        f"results/eval/{model}@{engine}/{task}/{ctx}.parquet"
        for engine, names in engine_tasks.items()
        for model in EVALUATED
        for task in names
        for ctx in config["tasks"][task]["context_tokens"]
    ]


def speed_rows():
    """The speed jobs `speed_benchmarks` lists: throughput and the engine-vs-pipeline benchmark per (model, context
    length); on CUDA, the decode kernels. None with `speed_benchmarks: []` (a workload-only run)."""
    wanted = config["speed_benchmarks"]
    return [
        f"results/speed/{kind}/{model}/{ctx}.parquet"
        for kind, lengths in (("throughput", config["throughput"]["context_tokens"]), ("engine_vs_pipeline", config["benchmark"]["context_tokens"]))
        if kind in wanted
        for model in EVALUATED
        for ctx in lengths
    ] + [f"results/speed/decode_kernels/{model}.parquet" for model in EVALUATED if config["device"] == "cuda" and "decode_kernels" in wanted]


def calibration_tables():
    """Every calibration table of every model."""
    return [f"results/calibration/{model}/{table}.parquet" for model in MODELS for table in CALIBRATION_TABLES]


def calibration_inputs(wildcards):
    """The model's calibration, for jobs whose methods take a value from it (e.g. `n_sink: calibrated`)."""
    if uses_calibration(for_task(METHODS, getattr(wildcards, "task", None))):
        return [f"results/calibration/{wildcards.model}/{table}.parquet" for table in CALIBRATION_TABLES]
    return []


def dataset_rows(wildcards):
    """A dataset task's file (the user's, or the one its recipe writes), so that a changed file reruns its jobs."""
    return task_inputs(config["tasks"][wildcards.task])


def serve_inputs(wildcards):
    """The inputs of a serving-engine job (of the serve rule): the engine's environment, the model folder, and for
    llama.cpp the model's GGUF file (vLLM reads the folder kvlab evaluates)."""
    inputs = {"model_dir": f"resources/models/{wildcards.model}", "env": f".venv-{wildcards.engine}/.installed"}
    if KINDS[wildcards.engine].reads_gguf:
        inputs["gguf"] = f"resources/gguf/{wildcards.model}.gguf"
    return inputs


def run_params(task=None):
    """The evaluation knobs a measuring job receives (kvlab.state.jobs.run_params), with only `task`'s methods."""
    return job_params(config, METHODS, task)


def check_local_device():
    """Before the first job of a run whose jobs run here (onstart: not a dry run; a cluster submission's jobs run on
    its GPU nodes): device cuda needs a GPU on this machine; a dtype floor this machine cannot measure is said once."""
    if workflow.local_exec:
        try:
            check_device(config)
        except ConfigError as error:
            raise WorkflowError(f"kvlab {error}") from None
        say(dtype_floor_note(config))


def model_dirs():
    """Acquired model folders (each holds card.json)."""
    return [f"resources/models/{model}" for model in MODELS]


def report_db(wildcards):
    """The report's database. A run that executes (not a dry run or --summary) first removes the files made
    from a missing one, stage by stage: Snakemake rebuilds no missing file whose products exist, so after an
    interrupted collect it would keep the old report and no database (kvlab.state.runstate.drop_orphans)."""
    db = "results/kvlab.duckdb"
    if workflow.exec_mode.name == "DEFAULT" and workflow.execution_settings is not None and not workflow.dryrun:
        say(*drop_orphans([(list(map(str, rules.collect.input)), [db]), ([db], list(map(str, rules.report.output)))]))
    return db
