"""Tokenization: token-id arrays (memmap .npy) of training points, test points and labels, with the encoder's fast tokenizer and the dataset's max_len."""

from assets._stage import stage_asset

build = stage_asset("tokenize", group="data", kinds={"python", "numpy"}, description=__doc__)
