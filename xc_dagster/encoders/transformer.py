"""The Siamese text encoder E: text -> unit sphere, shared by points and labels (NGAME/SiameseXML M1).

A Hugging Face transformer with mean (or CLS) pooling and L2 normalisation (``xc_dagster.encoders.loading``
loads it from a name or folder).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xc_dagster.errors import XCConfigError


class SiameseEncoder(torch.nn.Module):
    """Transformer + pooling + L2 normalisation; ``forward(ids, mask)`` returns unit vectors."""

    cpu_batch_tokens = 2048  # inference on a CPU: padded tokens per forward, activations in cache (encode_tokens)

    def __init__(self, transformer: torch.nn.Module, pooling: str = "mean"):
        super().__init__()
        if pooling not in ("mean", "cls"):
            raise XCConfigError(f"pooling: expected mean|cls, got {pooling!r}")
        self.transformer = transformer
        self.pooling = pooling

    @property
    def dim(self) -> int:
        return int(self.transformer.config.hidden_size)

    def freeze_bottom(self, n: int) -> None:
        """Stop training the input embeddings and the lowest ``n`` transformer layers (``requires_grad`` off),
        so backward stops below layer ``n``. 0 freezes nothing."""
        if n <= 0:
            return
        layers = transformer_layers(self.transformer)
        if n > len(layers):
            raise XCConfigError(f"pretrain.freeze_layers: expected at most the encoder's {len(layers)} layers, "
                                f"got {n}")
        emb = getattr(self.transformer, "embeddings", None) or self.transformer.get_input_embeddings()
        for module in (emb, *layers[:n]):
            module.requires_grad_(False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer(input_ids=ids, attention_mask=mask).last_hidden_state
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
        return F.normalize(pooled.float(), dim=-1)


def transformer_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The stack of transformer blocks of an HF encoder (BERT's ``encoder.layer``, DistilBERT's
    ``transformer.layer``, ...): the ModuleList with ``config.num_hidden_layers`` entries."""
    n = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise XCConfigError(f"pretrain.freeze_layers: no stack of {n} transformer layers found in "
                        f"{type(model).__name__}")


