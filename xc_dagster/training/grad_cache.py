"""Gradient caching (GradCache, Gao et al. 2021; as DEXML trains): a training step's encoder activations bounded
by one chunk's, whatever the batch size and the text length.

A contrastive or one-vs-all loss couples every text of the batch, so a plain step keeps the activations of every
chunk until backward. ``StepEmbedder`` with ``cached`` instead (1) embeds each length-sorted chunk under
``torch.no_grad()``, recording its inputs, the RNG state (CPU and the chunk's CUDA device) and the encoder's
buffers before it; (2) hands the loss the chunks' embeddings as leaves, so ``backward(loss)`` first gives
d loss / d embedding; (3) re-runs each chunk with autograd from its recorded state -- the same dropout masks,
the same spectral-norm vectors, the same autocast -- and backpropagates that chunk's embedding gradient into the
encoder. The encoder's gradients equal the plain backward's to float rounding, the embeddings the loss and the
samplers see are the same values, and the RNG and buffers are left as a plain step leaves them. The price is a
second forward pass per chunk (docs/decisions.md#grad-cache).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from xc_dagster.encoders.encode import embed_rows


@dataclass(frozen=True)
class RngState:
    """The torch generators a forward pass draws from: the CPU one and, for a CUDA chunk, its device's."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    cuda_index: int | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        """The current state of the generators ``device``'s kernels (dropout) draw from."""
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return cls(torch.get_rng_state(), torch.cuda.get_rng_state(index), index)
        return cls(torch.get_rng_state(), None, None)

    def restore(self) -> None:
        """Set the generators back to this state."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.cuda_index)


@dataclass
class CachedChunk:
    """One chunk of a gradient-cached step: its inputs, the state its forward started from, its embedding leaf."""

    ids: torch.Tensor
    mask: torch.Tensor
    rng: RngState
    buffers: list[torch.Tensor]
    leaf: torch.Tensor


class StepEmbedder:
    """Embeds the texts of a training step and backpropagates its loss into the encoder: plainly (autograd
    through every chunk, activations of the whole batch held) or gradient-cached (one chunk's activations).

    ``embed`` may be called several times per step (points, then labels); ``backward(loss)`` ends the step.
    """

    def __init__(self, encoder: torch.nn.Module, device: torch.device, dtype: torch.dtype | None, chunk_size: int,
                 cached: bool):
        self.encoder, self.device, self.dtype = encoder, device, dtype
        self.chunk_size, self.cached = int(chunk_size), bool(cached)
        self._chunks: list[CachedChunk] = []

    @contextlib.contextmanager
    def _precision(self) -> Iterator[None]:
        """The step's autocast, set explicitly (an outer context cannot differ between forward and re-forward)."""
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            yield

    def embed(self, ids: np.ndarray, lens: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """Embeddings of ``rows`` in ``rows`` order (the encoder's output dtype), differentiable towards the
        encoder: directly (plain) or through ``backward`` (cached)."""
        forward = self._record if self.cached else None
        with self._precision():
            return embed_rows(self.encoder, ids, lens, rows, self.chunk_size, self.device, forward=forward)

    def _record(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One chunk's embeddings without autograd, its replay state kept; returns them as a leaf."""
        rng = RngState.capture(self.device)
        buffers = [b.detach().clone() for b in self.encoder.buffers()]
        with torch.no_grad():
            out = self.encoder(ids, mask)
        leaf = out.detach().requires_grad_()
        self._chunks.append(CachedChunk(ids, mask, rng, buffers, leaf))
        return leaf

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the step's ``loss`` into every parameter it reaches, the encoder's included."""
        loss.backward()
        chunks, self._chunks = self._chunks, []
        if chunks:
            self._replay(chunks)

    def _replay(self, chunks: list[CachedChunk]) -> None:
        """Re-run each chunk with autograd from its recorded RNG and buffers; backpropagate its leaf's gradient.

        The RNG and the buffers are left as the first pass left them (as after a plain step)."""
        after_rng = RngState.capture(self.device)
        after_buffers = [b.detach().clone() for b in self.encoder.buffers()]
        try:
            for chunk in chunks:
                if chunk.leaf.grad is None:  # the loss did not use these embeddings
                    continue
                chunk.rng.restore()
                _copy_into(self.encoder.buffers(), chunk.buffers)
                with self._precision():
                    out = self.encoder(chunk.ids, chunk.mask)
                out.backward(chunk.leaf.grad.to(out.dtype))
        finally:
            after_rng.restore()
            _copy_into(self.encoder.buffers(), after_buffers)

    def discard(self) -> None:
        """Forget the recorded chunks of a step that will not be backpropagated."""
        self._chunks = []


def _copy_into(targets: Iterator[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Copy ``values`` into the tensors ``targets`` (same order), without autograd."""
    with torch.no_grad():
        for target, value in zip(targets, values):
            target.copy_(value)


def embed_examples(embedder: StepEmbedder, src: np.ndarray, point_tokens: tuple[np.ndarray, np.ndarray],
                   label_tokens: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
    """Embeddings (towards the encoder's gradient) of a batch of examples: point and label texts, in batch order."""
    lab = src < 0
    parts, where = [], []
    if (~lab).any():
        parts.append(embedder.embed(*point_tokens, src[~lab]).float())
        where.append(np.flatnonzero(~lab))
    if lab.any():
        parts.append(embedder.embed(*label_tokens, -1 - src[lab]).float())
        where.append(np.flatnonzero(lab))
    x = torch.cat(parts)
    back = torch.from_numpy(np.argsort(np.concatenate(where), kind="stable")).to(x.device)
    return x[back]
