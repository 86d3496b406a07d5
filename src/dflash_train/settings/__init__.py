"""The job's schema: one tree of section dataclasses, and every subcommand's flags built from it.

    sections.py   the sections no lower component owns: [run], [data], [drafter], [pipeline]
    tree.py       TrainConfig: every section of a train run, their cross-checks, the TOML file
    commands.py   which sections (and fields) each subcommand takes, its flags, the parsed sections

A component declares its own section where it lives (objective.ObjectiveConfig, training.config's
[optimizer] and [trainer], data.regen_common.RegenConfig, eval.evaluate.EvalConfig,
profiling.session.ProfilingConfig) and receives only that section.
"""
