"""Training: the trainers of the pipeline's stages, their losses and their state.

Each trainer is an object that owns its state (model, optimizers, schedule, samplers, generator) and exposes
``step(batch)`` = ``update(batch_loss(batch))`` plus ``state`` / ``load_state`` for checkpoints; ``train_*`` is
the short loop over it that the pipeline calls. Losses chosen by a config string sit in
``losses.PAIR_LOSSES`` (``pretrain.loss``) and ``losses.CLASSIFIER_LOSSES`` (``classifier.loss``).

=====================================================  ==============================================================
paper component                                        where
=====================================================  ==============================================================
NGAME M1 / SiameseXML Module I: Siamese pretraining    ``siamese.SiameseTrainer``, ``siamese.train_siamese``
of the shared encoder
NGAME's OHNM triplet loss                              ``losses.ohnm_triplet_loss`` (``pretrain.loss=triplet``)
SiameseXML's probabilistic contrastive loss            ``losses.siamesexml_loss`` (``pretrain.loss=siamesexml``)
InfoNCE (in-batch softmax)                             ``losses.infonce_loss`` (``pretrain.loss=infonce``)
DEXML's decoupled softmax (in-batch)                   ``losses.dexml_loss`` (``pretrain.loss=dexml``)
NGAME M2/M4, SiameseXML Module IV: one-vs-all W on     ``classifier.ClassifierTrainer``, ``train_classifiers``
the hardest negatives
NGAME M2's multi-positive triplet loss                 ``losses.multi_positive_triplet_loss`` (``triplet``)
SiameseXML Module IV's contrastive loss                ``losses.siamesexml_classifier_loss`` (``siamesexml``)
BCE on the candidates                                  ``losses.masked_bce_loss`` (``classifier.loss=bce``)
SiameseXML Module IV: the residual block trained       ``classifier.ClassifierTrainer`` with ``encoder``
with W                                                 (``classifier.train_residual``)
propensity-scored loss (Jain et al. 2016)              ``classifier.propensity_label_weights``
ASTRA / MIPS-s: BCE over sampled negatives, the        ``end_to_end.EndToEndTrainer``, ``train_end_to_end``
encoder optionally end to end
ASTRA's model-parallel W (sharded by label), SGD or    ``sharded.ShardedClassifier``, ``sharded.ShardedOptimizer``
SparseAdam on the touched rows                         (``ROW_OPTIMIZERS``, ``classifier.w_optimizer``)
learning-rate schedules                                ``schedules``
Renee / ASTRA: label texts as training points          ``label_points`` (``pretrain.label_points``,
                                                       ``classifier.label_points``)
per-epoch checkpoints, bit-identical resume            ``checkpoint``
GradCache (Gao et al. 2021): encoder steps with one    ``grad_cache.StepEmbedder`` (``pretrain.grad_cache``,
chunk's activations                                    ``classifier.grad_cache``)
a step's predicted memory: grad caching, chunk size    ``memory.plan_step_memory``
=====================================================  ==============================================================
"""
