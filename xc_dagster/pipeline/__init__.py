"""The pipeline's stages as plain functions: read upstream artifacts, compute, write this stage's artifacts.

One module per stage (``ingest``, ``tokenize``, ``pretrain``, ``mining``, ``classifier``, ``index``, ``fusion``,
``evaluate``), each with ``run(ctx)``; what each reads and writes is declared in ``xc_dagster.artifacts``. Every
Dagster asset in ``assets/`` is a thin call of one of them, so the whole pipeline also runs from a script or
notebook (``run_all``). Each stage writes atomically into ``<artifacts>/<dataset>/<stage>/`` and returns a
summary of sizes, timings and key numbers.
"""

from xc_dagster.artifacts import STAGE_ORDER
from xc_dagster.pipeline.context import StageContext
from xc_dagster.pipeline.run import STAGES, run_all, run_stage

__all__ = ["STAGE_ORDER", "STAGES", "StageContext", "run_all", "run_stage"]
