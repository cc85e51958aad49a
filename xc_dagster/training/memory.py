"""A training step's memory, predicted before the first step: grad caching and the chunk size chosen from it.

A step that trains the encoder holds its activations until backward: about ``texts x (layers x (a T h + b T i
+ c heads T^2) + e T h)`` bytes for texts of T tokens (hidden size h, feed-forward size i), the constants
measured per precision (``bench/train_memory.py calibrate``, bench/TRAIN_MEMORY.md). ``plan_step_memory``
predicts the plain step's memory (the whole batch's activations) and the gradient-cached one's (one chunk's,
``xc_dagster.training.grad_cache``), compares them with the memory this process can still take
(``available_memory``: MemAvailable or the cgroup's headroom, whichever is smaller; the free memory of a CUDA
device), and returns the plan: grad caching on or off, and the largest chunk up to the configured one that
fits. When not even a one-text chunk fits it raises an ``XCConfigError`` naming the fields to lower, instead of
the kernel's OOM killer ending the run (docs/decisions.md#grad-cache).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from xc_dagster.errors import XCConfigError

GRAD_CACHE_MODES = ("auto", "on", "off")
# share of the available memory a training step may fill with its activations, gradients and optimizer state
# (the rest: the data, the samplers' banks and indexes, the allocator's slack, other processes)
STEP_MEMORY_SHARE = 0.5
# a transformer's activations, bytes per (T h, T i, heads T^2) per layer and per T h outside the layers, per text
# of T tokens: the training forward + backward peak fitted over 4 shapes x 32..256 tokens (bench/train_memory.py
# calibrate; T h and T i cannot be told apart when every shape has i = 4 h), times 1.3 so that every measured
# peak lies below it (bench/TRAIN_MEMORY.md); by the autocast dtype's element size
ACTIVATION_COEFFS: dict[int, tuple[float, float, float, float]] = {
    4: (0.0, 33.0, 16.0, 40.0),  # fp32
    2: (0.0, 35.0, 8.0, 27.0),  # bf16 / fp16 autocast (CPU autocast keeps many activations in fp32)
}
BAG_TOKEN_BYTES = 0.5  # the bag encoder (no layers): bytes per T h per text (measured 0.3)
STEP_FIXED_BYTES = 96 * 2 ** 20  # a step's workspace whatever its size (measured 40-70 MiB)
EMBEDDING_COPIES = 6  # a text's embedding in a step: chunk output, leaf, its gradient, concatenation, gathers
LOSS_BYTES_PER_PAIR = 64.0  # a scored (text, label) pair: similarity, mask, hardest-negative selection, gradients
GIB = 1024 ** 3
CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
TextGroup = tuple[int, int, float]  # texts of a step: count, longest (tokens), root-mean-square length


@dataclass(frozen=True)
class EncoderShape:
    """What a step's memory depends on in the encoder: its widths, depth, heads and trainable parameters."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    trainable: int  # trainable parameters (their gradient and AdamW's two moments)

    @classmethod
    def of(cls, encoder: torch.nn.Module) -> EncoderShape:
        """A transformer's shape from its config; an encoder without one (the bag encoder) has no layers."""
        trainable = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
        cfg = getattr(getattr(encoder, "transformer", None), "config", None)
        if cfg is None:
            return cls(int(encoder.dim), 0, 0, 0, trainable)
        hidden = int(cfg.hidden_size)
        return cls(hidden, int(cfg.num_hidden_layers), int(cfg.num_attention_heads),
                   int(getattr(cfg, "intermediate_size", 4 * hidden)), trainable)


def activation_bytes(shape: EncoderShape, texts: int, tokens: int, dtype: torch.dtype | None) -> float:
    """Peak activation memory of a training forward + backward over ``texts`` texts padded to ``tokens``."""
    T = max(int(tokens), 1)
    if shape.layers == 0:
        return float(texts) * BAG_TOKEN_BYTES * T * shape.hidden
    a, b, c, e = ACTIVATION_COEFFS[2 if dtype in (torch.bfloat16, torch.float16) else 4]
    per_layer = a * T * shape.hidden + b * T * shape.intermediate + c * shape.heads * T * T
    return float(texts) * (shape.layers * per_layer + e * T * shape.hidden)


def state_bytes(shape: EncoderShape, dtype: torch.dtype | None) -> float:
    """Gradients and AdamW moments of the trainable parameters (fp32), plus autocast's low-precision weights."""
    return shape.trainable * (12.0 + (2.0 if dtype is not None else 0.0))


def step_loss_bytes(texts: int, pairs: int, hidden: int) -> float:
    """The loss's share of a step: the texts' embeddings (leaves, gradients, gathers) and the scored pairs."""
    return EMBEDDING_COPIES * 4.0 * texts * hidden + LOSS_BYTES_PER_PAIR * pairs


def text_lengths(tokens: tuple[np.ndarray, np.ndarray]) -> tuple[int, float]:
    """The longest row of a (token ids, lengths) pair -- what the first length-sorted chunk is padded to -- and
    the rows' root-mean-square length (a plain step's texts on average; the T^2 term weighs long texts more)."""
    lens = np.asarray(tokens[1], dtype=np.float64)
    if not len(lens):
        return 1, 1.0
    return max(int(lens.max()), 1), max(float(np.sqrt(np.mean(lens * lens))), 1.0)


def predict_step_memory(shape: EncoderShape, groups: Sequence[TextGroup], chunk_size: int,
                        dtype: torch.dtype | None, cached: bool, loss_bytes: float = 0.0) -> float:
    """Bytes a training step adds to the process: the encoder's state, the loss's, a fixed workspace, and the
    activations of the whole batch at its typical length (plain) or of its longest chunk (``cached``).

    ``groups``: the step's texts as (count, longest, root-mean-square length) triples, e.g. points and labels."""
    if cached:
        act = max((activation_bytes(shape, min(n, chunk_size), longest, dtype) for n, longest, _ in groups if n > 0),
                  default=0.0)
    else:
        act = sum(activation_bytes(shape, n, min(typical, longest), dtype) for n, longest, typical in groups)
    return state_bytes(shape, dtype) + float(loss_bytes) + STEP_FIXED_BYTES + act


def _read_int(path: Path) -> int | None:
    """An integer file of the cgroup tree; None when absent, unreadable or ``max``."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, key: str) -> int:
    """One ``key value`` line of a cgroup ``memory.stat``; 0 when absent."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def cgroup_headroom() -> int | None:
    """The cgroup's limit minus its working set (usage less reclaimable file cache); None without a limit."""
    for limit_f, usage_f, stat_key in ((CGROUP_V2 / "memory.max", CGROUP_V2 / "memory.current", "inactive_file"),
                                       (CGROUP_V1 / "memory.limit_in_bytes", CGROUP_V1 / "memory.usage_in_bytes",
                                        "total_inactive_file")):
        limit, usage = _read_int(limit_f), _read_int(usage_f)
        if limit is None or usage is None or limit >= 1 << 60:  # v1 writes "no limit" as ~2^63
            continue
        working = usage - _stat_value(limit_f.parent / "memory.stat", stat_key)
        return max(limit - max(working, 0), 0)
    return None


def mem_available() -> int | None:
    """The kernel's estimate of memory available without swapping (``MemAvailable``); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory(device: torch.device) -> int | None:
    """Bytes this process can still take on ``device``: a CUDA device's free memory (plus what torch's
    allocator holds unused); on the CPU MemAvailable or the cgroup's headroom, whichever is smaller. None
    where neither is known (no check then)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    known = [v for v in (mem_available(), cgroup_headroom()) if v is not None]
    return min(known) if known else None


@dataclass(frozen=True)
class MemoryPlan:
    """How a trainer runs its steps: grad caching or not, the chunk size, and the numbers behind the choice."""

    grad_cache: bool
    chunk_size: int
    predicted_bytes: float  # the chosen way's step
    plain_bytes: float  # the plain step's (whole batch)
    available_bytes: float | None

    def summary(self) -> dict[str, Any]:
        return {k: (round(v / GIB, 3) if k.endswith("_bytes") and v is not None else v)
                for k, v in asdict(self).items()}


def plan_step_memory(shape: EncoderShape, groups: Sequence[TextGroup], dtype: torch.dtype | None,
                     mode: str, chunk_size: int, available: int | None, fields: dict[str, Any],
                     loss_bytes: float = 0.0, mode_field: str = "grad_cache") -> MemoryPlan:
    """Grad caching per ``mode`` (``GRAD_CACHE_MODES``; auto: only when the plain step does not fit) and the
    largest chunk up to ``chunk_size`` whose step fits ``STEP_MEMORY_SHARE`` of ``available``.

    ``fields``: the ``stage.field`` names and values an error names (chunk size, batch size, max_len);
    ``mode_field``: the grad-cache field's name. Raises XCConfigError when not even a one-text chunk fits (or,
    with ``off``, the whole batch)."""
    plain = predict_step_memory(shape, groups, chunk_size, dtype, False, loss_bytes)
    if available is None:
        return MemoryPlan(mode == "on", chunk_size, plain, plain, None)
    budget = STEP_MEMORY_SHARE * available
    if mode == "off" or (mode == "auto" and plain <= budget):
        if plain > budget:
            raise memory_error(plain, available, fields, "the whole batch's activations, grad caching off",
                               f" or set {mode_field}=auto")
        return MemoryPlan(False, chunk_size, plain, plain, available)
    room = budget - state_bytes(shape, dtype) - loss_bytes - STEP_FIXED_BYTES
    chunk = int(chunk_size)
    for n, longest, _ in groups:  # a group's chunks hold min(n, chunk) texts
        fit = int(room // max(activation_bytes(shape, 1, longest, dtype), 1.0))
        if n > fit:
            chunk = min(chunk, fit)
    need = predict_step_memory(shape, groups, max(chunk, 1), dtype, True, loss_bytes)
    if chunk < 1:
        raise memory_error(need, available, fields, "one text per chunk, grad caching on")
    return MemoryPlan(True, chunk, need, plain, available)


def memory_error(need: float, available: float, fields: dict[str, Any], what: str, hint: str = "") -> XCConfigError:
    """The error of a step that cannot fit: predicted vs available memory and the fields that set its size."""
    names = ", ".join(f"{k}={v}" for k, v in fields.items())
    return XCConfigError(
        f"a training step is predicted to need {need / GIB:.2f} GiB ({what}, with the optimizer state) but "
        f"{STEP_MEMORY_SHARE:.0%} of the {available / GIB:.2f} GiB available (MemAvailable, cgroup limit or "
        f"free GPU memory) is {STEP_MEMORY_SHARE * available / GIB:.2f} GiB; lower one of {names}{hint}")


def end_to_end_memory_plan(encoder: torch.nn.Module, point_tokens: tuple[np.ndarray, np.ndarray],
                           label_tokens: tuple[np.ndarray, np.ndarray], params: Any, src: np.ndarray,
                           device: torch.device, dtype: torch.dtype | None) -> MemoryPlan:
    """Grad caching and the chunk size of the end-to-end steps (``EndToEndTrainerParams``), from their predicted
    memory: B example texts (``src``: the examples' sources, labels < 0; a batch holds
    them in proportion), each scored against its positives and negatives."""
    B = min(params.batch_size, len(src))
    n_labels = int(round(B * float(np.mean(src < 0)))) if len(src) else 0
    groups = [(B - n_labels, *text_lengths(point_tokens)), (n_labels, *text_lengths(label_tokens))]
    pairs = B * (params.num_positives + params.num_hard + params.num_random)
    loss = step_loss_bytes(B, pairs, encoder.dim) + 12.0 * pairs * encoder.dim  # the scored rows of W, their grads
    fields = {"classifier.chunk_size": params.chunk_size, "classifier.batch_size": params.batch_size,
              "tokenize.max_len": point_tokens[0].shape[1]}
    return plan_step_memory(EncoderShape.of(encoder), groups, dtype, params.grad_cache, params.chunk_size,
                            available_memory(device), fields, loss, "classifier.grad_cache")
