"""The shapes-video model's text side: a T5 tokenizer that knows every moving-shapes grammar word as one token, and a
small frozen random UMT5 encoder (Wan's text encoder family) whose outputs the transformer learns to read.

The encoder is never trained: its weights are drawn from a seed, as the tiny models' are. `TEXT_LENGTH` tokens cover
the longest prompt (9 words) with its end token; it is the checkpoint's `max_sequence_length`.
"""

from __future__ import annotations

from dataclasses import dataclass

from omniroll.models.tiny._common import build_t5_tokenizer, seeded
from omniroll.tasks.moving_shapes.grammar import all_prompts, grammar_words
from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD, MovingWorld

#: the shapes-video model's `max_sequence_length`
TEXT_LENGTH = 12


@dataclass(frozen=True)
class VideoTextRecipe:
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 64
    seed: int = 2


def build_text(recipe: VideoTextRecipe, world: MovingWorld = DEFAULT_MOVING_WORLD) -> dict:
    """{tokenizer, text_encoder}: every grammar word one token (RuntimeError naming any that is split, or a prompt
    longer than `TEXT_LENGTH` tokens), the UMT5 weights from `recipe.seed`, frozen."""
    from transformers import UMT5Config, UMT5EncoderModel

    words = tuple(grammar_words(world))
    tok = build_t5_tokenizer(words, max_length=TEXT_LENGTH)
    unsplit = [w for w in words if len(tok(w, add_special_tokens=False).input_ids) != 1]
    if unsplit:
        raise RuntimeError(f"the shapes-video tokenizer splits the grammar words {unsplit}")
    longest = max(all_prompts(world), key=lambda p: len(tok(p).input_ids))
    if len(tok(longest).input_ids) > TEXT_LENGTH:
        raise RuntimeError(f"the prompt {longest!r} is longer than TEXT_LENGTH = {TEXT_LENGTH} tokens")
    conf = UMT5Config(vocab_size=len(tok), d_model=recipe.d_model, d_ff=recipe.d_ff,
                      d_kv=recipe.d_model // recipe.num_heads, num_heads=recipe.num_heads,
                      num_layers=recipe.num_layers, relative_attention_num_buckets=8,
                      relative_attention_max_distance=TEXT_LENGTH, feed_forward_proj="gated-gelu",
                      is_encoder_decoder=False, use_cache=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, decoder_start_token_id=0)
    encoder = seeded(recipe.seed, 0, lambda: UMT5EncoderModel(conf)).requires_grad_(False)
    return {"tokenizer": tok, "text_encoder": encoder}
