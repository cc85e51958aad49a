"""Compute device and mixed precision: CUDA with AMP when there is a GPU, CPU otherwise -- one code path."""

from __future__ import annotations

import contextlib
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import torch

from xc_dagster.errors import XCConfigError

T, R = TypeVar("T"), TypeVar("R")


def on_threads(fn: Callable[[T], R], items: Sequence[T], threads: int | None = None) -> list[R]:
    """``[fn(x) for x in items]`` on ``threads`` threads (default: torch's, the process's CPU budget), in order; one
    thread, or one item, runs inline. For work whose heavy part releases the GIL (numpy, scipy sparse products)."""
    threads = min(threads or torch.get_num_threads(), len(items))
    if threads <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


def one_torch_thread_each(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]``, each item on a thread of its own that runs torch ops on one intra-op thread:
    inter-op parallelism, for many small torch programs that two intra-op threads share poorly (MiniLM's encoding
    chunks, docs/decisions.md#encode-token-budget). torch keeps the last ``set_num_threads`` as the count threads
    started later get, so each worker sets it back as it ends; the calling thread's own count never changes."""
    original = torch.get_num_threads()

    def one(x: T) -> R:
        torch.set_num_threads(1)
        try:
            return fn(x)
        finally:
            torch.set_num_threads(original)

    return on_threads(one, items, len(items))


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when available else ``cpu``; an explicit ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise XCConfigError(f"device {name!r} requested but torch sees no CUDA GPU")
    return dev


def amp_dtype(device: torch.device, amp: str = "auto") -> torch.dtype | None:
    """The autocast dtype for ``amp`` on ``device``; None = full fp32.

    ``auto``: bf16 on CUDA GPUs that support it (fp16 otherwise); on CPU bf16 where it pays (``cpu_bf16_pays``:
    AMX tiles, or bf16 matrix products at least 1.2x faster than fp32), else fp32
    (docs/decisions.md#amp-auto-on-cpu). ``bf16`` / ``off`` pin the choice.
    """
    if amp == "off":
        return None
    if amp == "bf16":
        return torch.bfloat16
    if amp == "fp16":
        return torch.float16
    if amp != "auto":
        raise XCConfigError(f"amp: expected auto|bf16|fp16|off, got {amp!r}")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_bf16_pays() else None


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Sapphire Rapids and later), Intel's bf16 matrix unit."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is not None:
        try:
            return bool(probe())
        except RuntimeError:
            return False
    try:  # older torch: the kernel's flags (Linux)
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def cpu_bf16_pays(min_speedup: float = 1.2) -> bool:
    """bf16 autocast is worth it on this CPU: AMX, or (measured once per process, ~0.3 s) two encoder-sized
    matrix products under bf16 autocast run ``min_speedup`` times faster than in fp32 (``speedup``)."""
    if cpu_has_amx():
        return True
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):
        return False
    return speedup(_feed_forward(None), _feed_forward(torch.bfloat16)) >= min_speedup


def _feed_forward(dtype: torch.dtype | None) -> Callable[[], object]:
    """A (2048 x 384) -> 1536 -> 384 feed-forward pair (a MiniLM block's shape), in fp32 or under ``dtype``
    autocast."""
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(*shape, generator=g) for shape in ((2048, 384), (1536, 384), (384, 1536)))

    def run() -> object:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            return torch.nn.functional.linear(torch.nn.functional.linear(x, w1), w2)

    return run


def speedup(slow: Callable[[], object], fast: Callable[[], object], reps: int = 7,
            max_seconds: float = float("inf")) -> float:
    """How many times faster ``fast`` runs than ``slow``: their fastest of ``reps`` timed runs each, interleaved
    (slow, fast, slow, ...) after a warm-up of each. The fastest, not the median: these products take milliseconds,
    less than a scheduler quantum, so on a busy machine (another process on the cores) a run is slowed by whether
    its threads got the cores, not by its precision: beside a test suite a median of 5 sequential runs measured int8
    0.83-1.25x and bf16 once 1.29x (4.2x and 0.45x alone), flipping both decisions (docs/decisions.md#probe-fastest).
    Runs stop once one of each was timed and ``max_seconds`` passed: where a product takes a second, a few say
    enough (the AMD EPYC's int8 product 1.0-1.7 s against fp32's 0.09: 31 of each took 31 s)."""
    best = [float("inf"), float("inf")]
    started = time.perf_counter()
    for i in range(2 * (reps + 1)):
        t = time.perf_counter()
        (fast if i % 2 else slow)()
        if i >= 2:  # the first of each is the warm-up
            best[i % 2] = min(best[i % 2], time.perf_counter() - t)
        if i >= 3 and i % 2 and time.perf_counter() - started > max_seconds:
            break
    return best[0] / best[1]


PROBE_MAX_SECONDS = 1.0  # the int8 probe's runs stop past this (a CPU whose products take 2-8 ms runs all 31)


@functools.lru_cache(maxsize=1)
def cpu_int8_pays(min_speedup: float = 1.5) -> bool:
    """int8 scoring is worth it for exact search on this CPU (VNNI and the like): measured once per process
    (~0.3 s, ``speedup`` over 31 runs of each, as these products take 2-8 ms), an exact-search block's int8 product
    (int32 out) runs ``min_speedup`` times faster than in fp32 (docs/decisions.md#exact-int8). False where torch has
    no int8 product for the CPU."""
    if not hasattr(torch, "_int_mm"):
        return False
    try:
        return speedup(_search_product(torch.float32), _search_product(torch.int8), reps=31,
                       max_seconds=PROBE_MAX_SECONDS) >= min_speedup
    except RuntimeError:
        return False


def _search_product(dtype: torch.dtype) -> Callable[[], object]:
    """A (256 x 384) x (384 x 8192) product into a kept output, as exact search runs it."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randint(-127, 128, shape, generator=g).to(dtype) for shape in ((256, 384), (8192, 384)))
    out = torch.empty(256, 8192, dtype=torch.int32 if dtype == torch.int8 else dtype)

    def run() -> object:
        with torch.inference_mode():
            return torch._int_mm(q, k.T, out=out) if dtype == torch.int8 else torch.matmul(q, k.T, out=out)

    return run


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with the fused kernel where torch has one for the parameters' device (CPU since torch 2.4, CUDA),
    else the default implementation: the same update to float rounding, several times faster on a CPU
    (docs/decisions.md#fused-adamw)."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError):  # older torch, or a device without the fused kernel
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """Autocast to ``dtype`` on ``device`` (no-op for None)."""
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA) so training is reproducible; numpy generators are passed explicitly."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
