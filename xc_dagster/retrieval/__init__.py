"""Retrieval: from a query embedding (and its TF-IDF row) to fused scores of a shortlist of labels.

=====================================================================  =============================================
NGAME's MIPS over the classifiers W and its dual MIPS over the label    ``retrieval/ann.py`` (``LabelIndex``: faiss
embeddings; MIPS-s's clustering-based MIPS (IVF); exact search          HNSW / IVF, exact ``exact_topk``)
SiameseXML Module II shortlist sources (ANNS^z, ANNS^mu, ANNS^x) and    ``retrieval/shortlist.py`` (``SOURCES``,
NGAME's dual MIPS: candidates, exact re-scoring, top-k                  ``retrieve``, ``label_centroids``, ``fuse``)
the lexical source: TF-IDF cosine to the label text plus a sparse kNN   ``retrieval/lexical.py`` (``LexicalIndex``:
vote of the training points (scikit-learn TF-IDF, scipy products)       fit, transform, scores, save / load)
SiameseXML alpha fusion (+ kNN, lexical and propensity terms)           ``retrieval/fusion/alpha.py``
NGAME Appendix C tree fusion                                            ``retrieval/fusion/tree.py``
the fusion registry (``fusion.method``) and the Fusion protocol          ``retrieval/fusion/__init__.py``
=====================================================================  =============================================
"""
