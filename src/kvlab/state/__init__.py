"""The run state, above the engine and the report: the config (`config`: checked and resolved, with `overlay`'s
presets and catalogue), what a rule's job gets (`jobs`), an evaluation job's memory plan (`memory`) and rounds
(`sequential`), its checkpoint (`resume`), and what an interrupted run left (`runstate`)."""
