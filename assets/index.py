"""Index build: ANNS (faiss HNSW, inner product) over the shortlist sources of `index.sources` -- the classifier
vectors W, the label embeddings, the label centroids, the training points (kNN) -- used at inference, plus the
held-out copy the fusion is fitted with. Reads the dataset, W and the deployed encoder's embeddings."""

from assets._stage import stage_asset

build = stage_asset("index", group="inference", kinds={"faiss"}, description=__doc__)
