"""Bag-of-embeddings text encoder (SiameseXML / Astec style): fast on CPU, same interface as SiameseEncoder.

E(x) = N(R(N(GELU(E^T x)))) where x is the L2-normalised TF-IDF vector of the text's tokens, E a (V, D) token
embedding table and R the spectrally normalised residual block of the SiameseXML code,
R(h) = h + Dropout(ReLU(r * (SN(W) h + b))) with W = I, b = 0 and a learnable radius r = 1 at init. The
intermediate normalisation is the paper's f_E(x) = N(GELU(Ex)); the final one puts E(x) on the unit sphere.

Inputs are the token ids the tokenize stage writes (MiniLM's WordPiece tokenizer), so the encoder plugs into
``encode_tokens``/``embed_rows`` unchanged. The embedding table starts from MiniLM's input word embeddings
when D = 384 and the vocabularies match (otherwise random). IDF is a non-trainable buffer that must be fitted
on the training corpus (``fit_idf``) before training; until then every non-special token weighs 1.

Saved without pickle: ``bag_encoder.json`` (type and shape) + ``bag_encoder.safetensors`` (state dict).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from xc_dagster.encoders.names import DEFAULT_BAG_DIM, resolve_encoder_path
from xc_dagster.errors import XCConfigError

BAG_TYPE = "bag-of-embeddings"
BAG_CONFIG_FILE = "bag_encoder.json"
BAG_WEIGHTS_FILE = "bag_encoder.safetensors"
DEFAULT_BAG_DROPOUT = 0.5  # DeepXML/SiameseXML code default
MINILM_EMBEDDING_KEY = "embeddings.word_embeddings.weight"


def is_bag_folder(path: str | Path) -> bool:
    """True for a folder written by ``BagOfEmbeddingsEncoder.save`` (detected by its JSON config)."""
    return (Path(path) / BAG_CONFIG_FILE).is_file()


# ---------------------------------------------------------------------------------------------- idf

def document_frequency(ids: np.ndarray, lengths: np.ndarray, vocab_size: int,
                       chunk_rows: int = 65536) -> np.ndarray:
    """Number of rows each token id occurs in (first ``lengths[i]`` ids of row i); memmaps read in chunks."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if ids.ndim != 2 or len(ids) != len(lengths):
        raise XCConfigError(f"fit_idf: expected (N, T) ids and N lengths, got {ids.shape} and {lengths.shape}")
    df = np.zeros(vocab_size, dtype=np.int64)
    width = ids.shape[1]
    for s in range(0, len(lengths), chunk_rows):
        block = np.asarray(ids[s:s + chunk_rows], dtype=np.int64)
        lens = np.minimum(lengths[s:s + chunk_rows], width)
        valid = np.arange(width)[None, :] < lens[:, None]
        toks = block[valid]
        if toks.size == 0:
            continue
        if toks.min() < 0 or toks.max() >= vocab_size:
            raise XCConfigError(f"fit_idf: token ids must lie in [0, {vocab_size}), got "
                                f"[{int(toks.min())}, {int(toks.max())}] (ids from another tokenizer?)")
        rows = np.broadcast_to(np.arange(len(block), dtype=np.int64)[:, None], block.shape)[valid]
        pairs = np.unique(rows * vocab_size + toks)  # one entry per (row, token): document, not term, counts
        df += np.bincount(pairs % vocab_size, minlength=vocab_size)
    return df


def idf_from_df(df: np.ndarray, n_docs: int, ignore: Iterable[int] = ()) -> np.ndarray:
    """Smoothed IDF ln((1 + N) / (1 + df)) + 1 (sklearn's; never 0 for seen tokens); ``ignore`` ids get 0."""
    idf = (np.log((1.0 + n_docs) / (1.0 + np.asarray(df, dtype=np.float64))) + 1.0).astype(np.float32)
    ign = np.fromiter(ignore, dtype=np.int64)
    idf[ign[(ign >= 0) & (ign < len(idf))]] = 0.0
    return idf


def fit_idf(ids: np.ndarray, lengths: np.ndarray, vocab_size: int, ignore: Iterable[int] = ()) -> np.ndarray:
    """IDF per token id (float32, (vocab_size,)) of a corpus of token-id rows; ``ignore`` (special tokens) -> 0."""
    return idf_from_df(document_frequency(ids, lengths, vocab_size), len(lengths), ignore)


# ------------------------------------------------------------------------------------------- modules

class SpectralResidual(torch.nn.Module):
    """h + Dropout(ReLU(r * (SN(W) h + b))), W = I, b = 0, r = 1 at init (SiameseXML code's Residual/SCLinear).

    At init the block maps h to h + ReLU(h) (eval mode or dropout 0): the identity only on non-negative
    inputs, not in general -- GELU outputs can be slightly negative.
    """

    def __init__(self, dim: int, dropout: float):
        super().__init__()
        linear = torch.nn.Linear(dim, dim)
        with torch.no_grad():
            torch.nn.init.eye_(linear.weight)
            linear.bias.zero_()
        # registered after the eye init so the power-iteration vectors start from W = I (sigma = 1)
        self.linear = torch.nn.utils.parametrizations.spectral_norm(linear)
        self.radius = torch.nn.Parameter(torch.ones(()))
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.dropout(F.relu(self.radius * self.linear(h)))


class BagOfEmbeddingsEncoder(torch.nn.Module):
    """TF-IDF weighted bag of token embeddings -> GELU -> N -> spectral residual -> N; unit (B, D) float32."""

    def __init__(self, vocab_size: int, dim: int = DEFAULT_BAG_DIM, dropout: float = DEFAULT_BAG_DROPOUT,
                 special_ids: Sequence[int] = (), sparse: bool = False):
        super().__init__()
        if vocab_size <= 0 or dim <= 0:
            raise XCConfigError(f"bag encoder: vocab_size and dim must be positive, got {vocab_size}, {dim}")
        if not 0.0 <= dropout < 1.0:
            raise XCConfigError(f"bag encoder: dropout must be in [0, 1), got {dropout}")
        self.vocab_size = int(vocab_size)
        self.dropout = float(dropout)
        self.special_ids = tuple(int(i) for i in special_ids if 0 <= int(i) < vocab_size)
        self.sparse = bool(sparse)
        # sparse=True gives sparse table gradients (use SparseAdam for it; AdamW and grad clipping reject them)
        self.embedding = torch.nn.EmbeddingBag(vocab_size, dim, mode="sum", sparse=self.sparse)
        with torch.no_grad():
            self.embedding.weight.normal_(0.0, dim ** -0.5)  # rows of about unit norm
        idf = torch.ones(vocab_size)
        idf[torch.tensor(self.special_ids, dtype=torch.long)] = 0.0
        self.register_buffer("idf", idf)  # saved with the weights, never trained
        self.residual = SpectralResidual(dim, dropout)

    @property
    def dim(self) -> int:
        return int(self.embedding.embedding_dim)

    def config(self) -> dict:
        """What ``load_bag_encoder`` needs to rebuild the module before loading the weights."""
        return {"type": BAG_TYPE, "vocab_size": self.vocab_size, "dim": self.dim, "dropout": self.dropout,
                "special_ids": list(self.special_ids), "sparse": self.sparse, "format_version": 1}

    def fit_idf(self, *corpora: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Set the IDF buffer from one or more ``(ids, lengths)`` corpora (e.g. train points and labels)."""
        if not corpora:
            raise XCConfigError("fit_idf: give at least one (ids, lengths) corpus")
        df = sum(document_frequency(ids, lens, self.vocab_size) for ids, lens in corpora)
        idf = idf_from_df(df, sum(len(lens) for _, lens in corpora), self.special_ids)
        with torch.no_grad():
            self.idf.copy_(torch.from_numpy(idf))
        return idf

    def set_pretrained_embeddings(self, table: torch.Tensor) -> None:
        """Copy a (vocab_size, dim) table into the embedding (e.g. MiniLM's input word embeddings)."""
        if tuple(table.shape) != tuple(self.embedding.weight.shape):
            raise XCConfigError(f"bag encoder: embedding table of shape {tuple(table.shape)}, expected "
                                f"{tuple(self.embedding.weight.shape)}")
        with torch.no_grad():
            self.embedding.weight.copy_(table.float())

    def tfidf_weights(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) weights such that sum_t w_t e_{ids_t} = E^T x with x the row's L2-normalised TF-IDF vector.

        Each occurrence of token t weighs idf_t / ||tf * idf||, so repeats add up to tf_t * idf_t / norm.
        Padding (mask 0) weighs 0; a row with no weighted token (only special tokens) averages its tokens.
        """
        m = mask.bool()
        idf = torch.where(m, self.idf[ids], torch.zeros((), device=ids.device))
        rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        key = torch.where(m, rows * self.vocab_size + ids, torch.full_like(ids, -1))
        _, inverse, counts = torch.unique(key, return_inverse=True, return_counts=True)
        tf = counts[inverse].to(idf.dtype)  # occurrences of this position's token in its row
        norm = (tf * idf * idf).sum(1, keepdim=True).sqrt()  # = ||(tf_t * idf_t)_t||_2
        w = idf / norm.clamp_min(1e-12)
        empty = norm.squeeze(1) <= 0
        if bool(empty.any()):
            fallback = m.to(idf.dtype) / m.sum(1, keepdim=True).clamp_min(1).to(idf.dtype)
            w = torch.where(empty.unsqueeze(1), fallback, w)
        return w

    def intermediate(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The paper's intermediate embedding f_E(x) = N(GELU(E^T x)) (before the residual), (B, D) float32."""
        w = self.tfidf_weights(ids, mask).to(self.embedding.weight.dtype)
        pooled = self.embedding(ids, per_sample_weights=w)
        return F.normalize(F.gelu(pooled.float()), dim=-1)

    def from_intermediate(self, h: torch.Tensor) -> torch.Tensor:
        """The final unit embedding N(R(h)) of intermediate embeddings h (SiameseXML Module IV trains R on them)."""
        return F.normalize(self.residual(h).float(), dim=-1)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.from_intermediate(self.intermediate(ids, mask))

    def save(self, out_dir: str | Path) -> None:
        """Write ``bag_encoder.json`` + ``bag_encoder.safetensors`` (no pickle) into ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out / BAG_WEIGHTS_FILE), metadata={"type": BAG_TYPE})
        (out / BAG_CONFIG_FILE).write_text(json.dumps(self.config(), indent=2) + "\n")


def embed_from_intermediate(encoder: BagOfEmbeddingsEncoder, h: np.ndarray, device: torch.device,
                            batch_size: int = 4096) -> np.ndarray:
    """The final unit embeddings N(R(h)) of (N, D) intermediate embeddings, in eval mode and in chunks: what
    ``encoder`` gives the texts, without re-reading their tokens (after Module IV changed only R)."""
    out = np.zeros(h.shape, dtype=np.float32)
    encoder.eval()
    with torch.inference_mode():
        for s in range(0, len(h), batch_size):
            chunk = torch.from_numpy(np.ascontiguousarray(h[s:s + batch_size], dtype=np.float32)).to(device)
            out[s:s + batch_size] = encoder.from_intermediate(chunk).cpu().numpy()
    return out


# -------------------------------------------------------------------------------------- create / load

def minilm_word_embeddings(path: str | Path | None = None) -> torch.Tensor:
    """MiniLM's (30522, 384) input word-embedding table, read from its safetensors file (no model built)."""
    if path is None:
        path = Path(resolve_encoder_path("minilm")) / "model.safetensors"
    try:
        with safe_open(str(path), framework="pt") as fh:
            key = next((k for k in fh.keys() if k.endswith(MINILM_EMBEDDING_KEY)), None)
            if key is None:
                raise XCConfigError(f"{path}: no tensor named *{MINILM_EMBEDDING_KEY}")
            return fh.get_tensor(key)
    except OSError as exc:
        raise XCConfigError(f"cannot read MiniLM word embeddings from {path} ({exc})") from exc


def create_bag_encoder(vocab_size: int, dim: int = DEFAULT_BAG_DIM, idf: np.ndarray | None = None,
                       dropout: float = DEFAULT_BAG_DROPOUT, special_ids: Sequence[int] = (),
                       init: str = "auto", sparse: bool = False, seed: int | None = None) -> BagOfEmbeddingsEncoder:
    """A fresh bag encoder. ``init``: ``minilm`` (MiniLM word embeddings; needs D = 384 and its vocabulary),
    ``random`` (N(0, 1/D)), or ``auto`` (minilm when it fits). ``idf`` None leaves uniform weights: call
    ``encoder.fit_idf((ids, lengths), ...)`` on the training corpus before training.
    """
    if init not in ("auto", "minilm", "random"):
        raise XCConfigError(f"bag encoder init: expected auto|minilm|random, got {init!r}")
    if seed is not None:
        torch.manual_seed(seed)
    enc = BagOfEmbeddingsEncoder(vocab_size, dim, dropout, special_ids, sparse)
    if init != "random":
        fits = dim == DEFAULT_BAG_DIM
        if fits:
            table = minilm_word_embeddings()
            fits = tuple(table.shape) == (vocab_size, dim)
        if fits:
            enc.set_pretrained_embeddings(table)
        elif init == "minilm":
            raise XCConfigError(f"bag encoder init=minilm needs vocab_size=30522 and dim=384, got "
                                f"{vocab_size} and {dim}")
    if idf is not None:
        idf_t = torch.as_tensor(np.asarray(idf, dtype=np.float32))
        if idf_t.shape != (vocab_size,):
            raise XCConfigError(f"bag encoder: idf of shape {tuple(idf_t.shape)}, expected ({vocab_size},)")
        enc.idf.copy_(idf_t)
    return enc


def load_bag_encoder(folder: str | Path) -> BagOfEmbeddingsEncoder:
    """Rebuild a saved bag encoder from ``bag_encoder.json`` and load ``bag_encoder.safetensors`` (strict)."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / BAG_CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise XCConfigError(f"{folder / BAG_CONFIG_FILE}: unreadable bag-encoder config ({exc})") from exc
    if cfg.get("type") != BAG_TYPE:
        raise XCConfigError(f"{folder / BAG_CONFIG_FILE}: expected type {BAG_TYPE!r}, got {cfg.get('type')!r}")
    try:
        enc = BagOfEmbeddingsEncoder(int(cfg["vocab_size"]), int(cfg["dim"]), float(cfg["dropout"]),
                                     cfg.get("special_ids", ()), bool(cfg.get("sparse", False)))
        state = load_file(str(folder / BAG_WEIGHTS_FILE))
        enc.load_state_dict(state, strict=True)
    except (KeyError, OSError, RuntimeError) as exc:
        raise XCConfigError(f"{folder}: cannot restore the bag encoder ({exc})") from exc
    enc.eval()
    return enc
