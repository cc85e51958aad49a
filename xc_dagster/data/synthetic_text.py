"""Words and texts of the generated datasets (:mod:`xc_dagster.data.synthetic`): a seeded vocabulary of made-up,
pronounceable words and the vectorised composition of point and label texts from word ids.

Words are two or three syllables ``consonant vowel [coda]`` (14 x 5 x 6 = 420 syllables: 176,400 short and 74M
long words). Every syllable starts with a consonant, so a coda is never followed by a vowel and different
syllable sequences spell different words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ONSETS = np.array(list("bdfgklmnprstvz"))
VOWELS = np.array(list("aeiou"))
CODAS = np.array(["", "n", "r", "s", "l", "m"])
SYLLABLES = np.strings.add(np.strings.add(np.repeat(ONSETS, 30), np.tile(np.repeat(VOWELS, 6), 14)),
                           np.tile(CODAS, 70))
N_SYL = len(SYLLABLES)


def spell(ids: np.ndarray, syllables: int) -> np.ndarray:
    """Words number ``ids`` of ``syllables`` syllables each (``ids`` < 420 ** syllables), as a string array."""
    out = np.full(len(ids), "", dtype="<U1")
    for s in range(syllables - 1, -1, -1):
        out = np.strings.add(out, SYLLABLES[(ids // N_SYL ** s) % N_SYL])
    return out


def make_vocabulary(rng: np.random.Generator, n: int, short_share: float = 0.3) -> np.ndarray:
    """``n`` distinct words in random order, ``short_share`` of them (at most 176,400) of two syllables and
    the rest of three, so that no kind of word (noise, cluster, label) can be told by its length."""
    n_short = min(round(short_share * n), N_SYL ** 2)
    if n - n_short > N_SYL ** 3:
        raise ValueError(f"at most {N_SYL ** 2 + N_SYL ** 3} words, asked {n}")
    short = spell(rng.choice(N_SYL ** 2, n_short, replace=False), 2)
    long = spell(rng.choice(N_SYL ** 3, n - n_short, replace=False), 3)
    return rng.permutation(np.concatenate([short, long]))


@dataclass(frozen=True)
class WordBuffer:
    """A vocabulary as one byte buffer: word ``w`` is ``buf[off[w]:off[w] + size[w]]`` followed by a space."""

    buf: np.ndarray
    off: np.ndarray
    size: np.ndarray

    @classmethod
    def of(cls, words: np.ndarray) -> WordBuffer:
        raw = np.frombuffer((" ".join(words.tolist()) + " ").encode("ascii"), dtype=np.uint8)
        size = np.strings.str_len(words).astype(np.int64)
        off = np.concatenate([[0], np.cumsum(size + 1)[:-1]])
        return cls(raw, off, size)

    def join_rows(self, words: np.ndarray, counts: np.ndarray) -> list[str]:
        """The texts of rows holding ``counts[i]`` words each (``words`` flat, row by row), words joined by a
        space; a row of no words is the empty text. One gather over the byte buffer, no loop per row."""
        n = len(counts)
        lens = self.size[words] + 1  # each word with the space after it
        ends = np.cumsum(lens)
        src = np.repeat(self.off[words] - (ends - lens), lens) + np.arange(int(ends[-1]) if len(ends) else 0)
        out = self.buf[src]
        last = np.cumsum(counts)[counts > 0] - 1  # the space after a row's last word ends the row
        out[ends[last] - 1] = ord("\n")
        text = out.tobytes().decode("ascii").split("\n")
        if counts.min(initial=1) > 0:
            return text[:n]
        full = iter(text)
        return [next(full) if c else "" for c in counts.tolist()]


def shuffle_rows(rng: np.random.Generator, rows: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Words grouped by row (``rows`` need not be sorted), each row's words in a random order."""
    order = np.lexsort((rng.random(len(rows)), rows))
    return rows[order], words[order]


def compose(rng: np.random.Generator, n: int, mention_rows: np.ndarray, mention_words: np.ndarray,
            n_words: np.ndarray, noise_cdf: np.ndarray, word_keep: float) -> tuple[np.ndarray, np.ndarray]:
    """Texts of ``n`` rows as (words flat by row, words per row): the signal words ``mention_words`` of row
    ``mention_rows``, each kept with probability ``word_keep`` (else a noise word), filled up to ``n_words`` words
    with noise words drawn by ``noise_cdf`` (noise word ids are 0 .. len(noise_cdf) - 1), in a random order."""
    swap = rng.random(len(mention_words)) >= word_keep
    mention_words = np.where(swap, _noise(rng, noise_cdf, len(mention_words)), mention_words)
    n_fill = np.maximum(n_words - np.bincount(mention_rows, minlength=n), 0)
    fill_rows = np.repeat(np.arange(n), n_fill)
    rows = np.concatenate([mention_rows, fill_rows])
    words = np.concatenate([mention_words, _noise(rng, noise_cdf, len(fill_rows))])
    rows, words = shuffle_rows(rng, rows, words)
    return words, np.bincount(rows, minlength=n)


def _noise(rng: np.random.Generator, cdf: np.ndarray, n: int) -> np.ndarray:
    return np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), len(cdf) - 1)
