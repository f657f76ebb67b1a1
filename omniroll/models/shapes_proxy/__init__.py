"""The shapes proxy: a small prompt-conditioned CNN that predicts whether the shapes world's exact checker passes a
picture, shipped with the package (`weights/`: model.safetensors, config.json, SHA256SUMS, train.json) as the
learned reward that can be fooled (`fn: shapes_proxy`, `omniroll.reward.shapes_proxy`).

`load_proxy(path=None)` loads it (the shipped one by default; its files are checked against SHA256SUMS first, and a
changed or missing file is named) on the CPU, once per process and path; `Proxy.scores(pictures, prompts)` gives
the predicted pass probability of each picture. `omniroll pretrain shapes-proxy --out DIR` (`make shapes-proxy`)
retrains it: `data.py` (the examples), `net.py` (the network), `train.py` (the recipe, the fit, the agreement).
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

#: the shipped proxy, inside the package
WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")
FILES = ("model.safetensors", "config.json")
#: what `omniroll.models.shipped.verified` calls it, and the command that makes it
WHAT, REMAKE = "the shapes proxy", "make shapes-proxy"


class Proxy:
    """A loaded proxy network (CPU, eval mode) and the directory it came from."""

    def __init__(self, net, path: str):
        self.net, self.path = net, path

    def scores(self, pictures: np.ndarray, prompts: list[str]) -> np.ndarray:
        """float [N] in [0, 1]: the predicted probability that the checker passes each picture (uint8
        [N, 64, 64, 3]) for its prompt (`PromptError` for a prompt outside the grammar)."""
        from omniroll.models.shapes_proxy.train import predict

        return predict(self.net, pictures, prompts)


@functools.lru_cache(maxsize=4)
def load_proxy(path: str | None = None) -> Proxy:
    """The proxy at `path` (default: the shipped one), verified against its SHA256SUMS and loaded on the CPU."""
    from safetensors.torch import load_file

    from omniroll.models.shapes_proxy.net import ProxyNet

    from omniroll.models.shipped import verified

    path = verified(os.path.abspath(path or WEIGHTS), WHAT, REMAKE, FILES)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)["net"]
    net = ProxyNet(config["vocab_size"], config["word_dim"], config["text_dim"], tuple(config["channels"]),
                   config["hidden"])
    net.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
    net.eval()
    return Proxy(net, path)
