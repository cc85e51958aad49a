"""Index build: ANNS (faiss HNSW, inner product) over the classifier vectors W and over the label embeddings -- the dual-MIPS shortlist used at inference."""

from assets._stage import stage_asset

build = stage_asset("index", "ann_index", deps=["classifiers"],
                    group="inference", kinds={"faiss"}, description=__doc__)
