"""The ``xc-dagster`` commands whose dependencies are heavy, one module each, imported by the CLI by name when one
runs (``xc_dagster.cli.COMMAND_MODULES``), so that the other commands start without them; each module's
``run(args, home)`` returns the exit code. ``partitions`` is what they share with the CLI.

============  ===================================================================================
module        command (and what it imports that the others need not)
============  ===================================================================================
plan          ``xc-dagster plan`` (torch, transformers and faiss: the planner's calibration)
compare       ``xc-dagster compare`` (MLflow: the evaluation runs)
clicks        ``xc-dagster clicks build`` (pandas: the click logs)
retrain       ``xc-dagster retrain check`` (pandas: the click-log feeds)
============  ===================================================================================
"""
