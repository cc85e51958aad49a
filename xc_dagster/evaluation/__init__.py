"""Evaluation: the XC metrics, the reports drawn from them, and the comparison of runs.

=====================================================================  =============================================
P@k, nDCG@k, recall@k, coverage@k; PSP@k, PSnDCG@k, PS-recall@k with    ``evaluation/metrics.py`` (``evaluate``, one
Jain et al.'s inverse propensities (pyxclib's definitions)              function per family, ``inverse_propensity``)
ranking / filtering kernels (top-k by score, filter pairs, duplicates)  ``evaluation/_ranking.py`` (private)
the per-family streaming sums over row blocks                           ``evaluation/_families.py`` (private)
many rankings of one fixed shortlist (a search over score weightings)   ``evaluation/fixed_shortlist.py``
NGAME fig. 3a head-to-tail decile contributions, recall by frequency,   ``evaluation/reports.py``
metric tables and P@k curves
runs of a dataset from MLflow beside the papers' reference results     ``evaluation/comparison.py``
=====================================================================  =============================================
"""
