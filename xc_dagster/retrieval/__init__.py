"""Retrieval: from a query embedding to fused scores of a shortlist of labels.

=====================================================================  =============================================
NGAME's MIPS over the classifiers W and its dual MIPS over the label    ``retrieval/ann.py`` (``LabelIndex``: faiss
embeddings; MIPS-s's clustering-based MIPS (IVF); exact search          HNSW / IVF, exact ``exact_topk``)
SiameseXML Module II shortlist sources (ANNS^z, ANNS^mu, ANNS^x) and    ``retrieval/shortlist.py`` (``SOURCES``,
NGAME's dual MIPS: candidates, exact re-scoring, top-k                  ``retrieve``, ``label_centroids``, ``fuse``)
SiameseXML alpha fusion (+ kNN and propensity terms)                    ``retrieval/fusion/alpha.py``
NGAME Appendix C tree fusion                                            ``retrieval/fusion/tree.py``
the fusion registry (``fusion.method``) and the Fusion protocol          ``retrieval/fusion/__init__.py``
=====================================================================  =============================================
"""
