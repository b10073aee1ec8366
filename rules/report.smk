rule report:
    input:
        db=report_db,
    output:
        html=report("results/report.html", caption="../workflow/report.rst", category="Report"),
        decision_grid=report("results/figures/decision_grid.svg", caption="../workflow/report_decision.rst", category="Figures"),
        accuracy_vs_kv_bytes=report("results/figures/accuracy_vs_kv_bytes.svg", caption="../workflow/report_accuracy.rst", category="Figures"),
        kl_vs_bits=report("results/figures/kl_vs_bits.svg", caption="../workflow/report_kl.rst", category="Figures"),
    params:
        title=config["report"]["title"],
        decision=config["decision"],
    log:
        "logs/report.log",
    localrule: True
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/report.yaml"
    script:
        "../workflow/report.py"
