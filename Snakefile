# kvlab: which KV-cache compression is safe for which task — measured on real models.
#   snakemake --cores 1 results/report.html                  (default preset)
#   snakemake --cores 1 results/report.html --config preset=smoke
import os

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version

min_version("9.0")

# Jobs log their progress to their log files and the console one line at a time; a progress bar's redraws would
# run into those lines (and into the lines of jobs beside them). Run with TQDM_DISABLE= (empty) to see them anyway.
os.environ.setdefault("TQDM_DISABLE", "1")

from kvlab.state.config import ConfigError, check_config_files
from kvlab.state.runstate import clear_stale_lock, record_owner, say

try:  # strict YAML (duplicate keys, syntax errors with file:line:column), before Snakemake merges the files
    check_config_files("config.yaml", workflow.config_settings.configfiles)
except ConfigError as error:
    raise WorkflowError(f"kvlab config: {error}") from None


configfile: "config.yaml"


include: "rules/common.smk"
include: "rules/models.smk"
include: "rules/calibrate.smk"
include: "rules/evaluate.smk"
include: "rules/speed.smk"
include: "rules/accounting.smk"
include: "rules/collect.smk"
include: "rules/report.smk"


# A lock left by a run that kill -9 stopped is removed when that run is gone (src/kvlab/state/runstate.py); the run
# records itself while it holds the lock (onstart). Files made from a missing one: report_db in rules/common.smk.
if workflow.exec_mode.name == "DEFAULT":
    say(clear_stale_lock())


onstart:
    check_local_device()
    record_owner()


rule all:
    default_target: True
    input:
        "results/report.html",
