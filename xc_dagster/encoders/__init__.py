"""Text encoders E: text -> unit sphere, shared by points and labels.

=================  ==================================================================================
``names``          what an encoder name means (packaged MiniLM, ``bag``, a folder or hub name)
``tokenizer``      the fast tokenizer; texts -> token-id arrays (the tokenize stage, serving requests)
``transformer``    ``SiameseEncoder``: a transformer with mean/CLS pooling (NGAME M1, SiameseXML's E)
``bag``            ``BagOfEmbeddingsEncoder``: TF-IDF-weighted token embeddings + residual block (SiameseXML)
``encode``         running an encoder over token ids in length-sorted chunks (inference and training)
``loading``        ``load_encoder`` / ``save_encoder`` for either kind, without pickle
=================  ==================================================================================
"""
