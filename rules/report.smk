rule report:
    input:
        db="results/kvlab.duckdb",
    output:
        html=report("results/report.html", caption="../workflow/report.rst", category="Report"),
    params:
        title=config["report"]["title"],
    log:
        "logs/report.log",
    localrule: True
    conda:
        "../envs/kvlab.yaml"
    script:
        "../workflow/report.py"
