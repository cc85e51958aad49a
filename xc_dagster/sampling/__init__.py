"""Sampling: which examples, positives and negatives a training step sees.

Components chosen by a config string sit in a registry (name -> class): ``batches.BATCH_SAMPLERS``
(``pretrain.sampler``), ``hard_negatives.HARD_NEGATIVE_POOLS`` and ``negatives.SAMPLED_NEGATIVES``
(``classifier.negatives``). A new component is one class and one registry line.

=====================================================  ==============================================================
paper component                                        where
=====================================================  ==============================================================
random mini-batches (pretraining, both classifier      ``batches.RandomBatches`` (``pretrain.sampler=random``)
trainers)
NGAME Algorithm 1: batches of clusters of the          ``batches.NGAMESampler`` (``pretrain.sampler=ngame``)
memory bank, curriculum on the cluster size
NGAME M2: batches of clusters of frozen embeddings     ``batches.ClusterBatches`` (``classifier.cluster_size``)
SiameseXML Module I: label batches ~ freq^0.45,        ``batches.SiameseXMLSampler`` (``siamesexml``); its draws:
positive and centroid points per label                 ``labels.sample_label_batch``, ``sample_label_points``
NGAME's balanced hierarchical 2-means                  ``clustering.balanced_clusters``, ``clustering.cluster_batches``
SiameseXML Module IV: hardest shortlist negatives      ``hard_negatives.ShortlistPool`` (``negatives=shortlist``)
NGAME M2: hardest in-batch negatives                   ``hard_negatives.InBatchPool`` (``in-batch``); with the
                                                       shortlist: ``ShortlistAndInBatchPool`` (``both``)
ASTRA Algorithm 1: stale-index hard negatives +        ``negatives.AstraNegatives`` (``negatives=astra``)
importance-weighted uniform ones
ASTRA's warm-up: uniform negatives only                ``negatives.UniformNegatives`` (``uniform``)
MIPS-s Algorithm 1: clustering-based MIPS over stale   ``negatives.MipsNegatives`` (``mips``)
W + uniform
the stale ANNS index over (sharded) W                  ``stale_index`` (``IndexSettings``, ``hard_negatives``)
positives per point, positive masks, de-duplication    ``labels``
=====================================================  ==============================================================
"""
