"""The shapes proxy's network: a small CNN on the 64 x 64 picture whose every layer is batch-normalised and
modulated by the prompt (FiLM: a scale and shift per channel computed from the prompt's words), ending in one logit,
the predicted log-odds that the exact checker passes the picture for that prompt.

The prompt is read as a sequence of grammar words (`grammar_words`, at most `MAX_WORDS`; a word embedding plus a
position embedding each, flattened so that "a circle left of a square" and "a square left of a circle" differ).
The picture gets two coordinate channels (x, y in [-1, 1]) so that position prompts can be read after pooling.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from omniroll.tasks.shapes.grammar import grammar_words, parse_prompt

#: the longest grammar prompt has 7 words ("a red circle and a blue square")
MAX_WORDS = 8


def vocabulary() -> dict[str, int]:
    """word -> id (0 is padding), the grammar's words in the grammar's order."""
    return {w: i + 1 for i, w in enumerate(grammar_words())}


def encode_prompts(prompts: list[str], vocab: dict[str, int]) -> np.ndarray:
    """int64 [N, MAX_WORDS]: each prompt's words (parsed, so case and a final full stop do not matter), 0-padded;
    `PromptError` for a prompt outside the grammar."""
    out = np.zeros((len(prompts), MAX_WORDS), dtype=np.int64)
    for i, p in enumerate(prompts):
        words = parse_prompt(p).prompt.split()
        out[i, :len(words)] = [vocab[w] for w in words]
    return out


class ProxyNet(nn.Module):
    """Prompt-conditioned CNN: `forward(pictures uint8 [N, 64, 64, 3] as a tensor, words [N, MAX_WORDS])` -> logits
    [N]."""

    def __init__(self, vocab_size: int, word_dim: int = 16, text_dim: int = 64,
                 channels: tuple[int, ...] = (16, 32, 32, 32), hidden: int = 64):
        super().__init__()
        self.config = {"vocab_size": vocab_size, "word_dim": word_dim, "text_dim": text_dim,
                       "channels": list(channels), "hidden": hidden}
        self.words = nn.Embedding(vocab_size + 1, word_dim, padding_idx=0)
        self.position = nn.Parameter(torch.randn(MAX_WORDS, word_dim) * 0.1)
        self.text = nn.Sequential(nn.Linear(MAX_WORDS * word_dim, text_dim), nn.GELU(),
                                  nn.Linear(text_dim, text_dim), nn.GELU())
        convs, norms, films, c_in = [], [], [], 5
        for c in channels:
            convs.append(nn.Conv2d(c_in, c, 3, stride=2, padding=1))
            norms.append(nn.BatchNorm2d(c, affine=False))  # FiLM supplies the scale and shift
            films.append(nn.Linear(text_dim, 2 * c))
            c_in = c
        self.convs, self.norms, self.films = nn.ModuleList(convs), nn.ModuleList(norms), nn.ModuleList(films)
        side = 64 // 2 ** len(channels)
        self.head = nn.Sequential(nn.Linear(c_in * side * side + text_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        for f in films:  # start as the identity modulation
            nn.init.zeros_(f.weight)
            nn.init.zeros_(f.bias)

    def forward(self, pictures: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        n = pictures.shape[0]
        x = pictures.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        side = x.shape[-1]
        ramp = torch.linspace(-1, 1, side, device=x.device)
        coords = torch.stack([ramp.view(1, -1).expand(side, side), ramp.view(-1, 1).expand(side, side)])
        x = torch.cat([x, coords.unsqueeze(0).expand(n, -1, -1, -1)], dim=1)
        t = self.text((self.words(words) + self.position).flatten(1))
        for conv, norm, film in zip(self.convs, self.norms, self.films):
            scale, shift = film(t).chunk(2, dim=1)
            x = torch.relu(norm(conv(x)) * (1 + scale[..., None, None]) + shift[..., None, None])
        return self.head(torch.cat([x.flatten(1), t], dim=1)).squeeze(1)
