"""The shapes-video model's text side: a T5 tokenizer that knows every moving-shapes grammar word as one token, and a
small frozen random text encoder whose outputs the transformer learns to read: a BERT (absolute position embeddings),
or Wan's own UMT5 family (the first shipped model's).

The encoder is never trained: its weights are drawn from a seed, as the tiny models' are. `TEXT_LENGTH` tokens cover
the longest prompt (9 words) with its end token; it is the checkpoint's `max_sequence_length`.

Why BERT: diffusers' `WanTransformer3DModel` cross-attends to the text with no position of its own, so it reads the
encoder's outputs as a set of vectors. A random UMT5 (relative position buckets inside its attention only) writes so
little order into them that prompts differing only in word order ("a circle appears, then a square" and its twin;
"a blue square turning green" and "a green square turning blue") come out nearly the same set: measured 0.08-0.21 as
far apart as unrelated prompts, against 0.61-1.30 for a random BERT of the same shape, whose absolute positions are
added to every token (docs/moving_shapes.md, "the text encoder"; `benchmarks/experiments/video_text_twins.py`).
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
    encoder: str = "bert"  # ENCODERS; a recipe.json written before this field is "umt5" (recipe.from_dict)


def build_text(recipe: VideoTextRecipe, world: MovingWorld = DEFAULT_MOVING_WORLD) -> dict:
    """{tokenizer, text_encoder}: every grammar word one token (RuntimeError naming any that is split, or a prompt
    longer than `TEXT_LENGTH` tokens), the encoder's weights from `recipe.seed`, frozen. `recipe.encoder` is one of
    `ENCODERS` (`ShapesVideoRecipe.check` says so before any work)."""
    words = tuple(grammar_words(world))
    tok = build_t5_tokenizer(words, max_length=TEXT_LENGTH)
    unsplit = [w for w in words if len(tok(w, add_special_tokens=False).input_ids) != 1]
    if unsplit:
        raise RuntimeError(f"the shapes-video tokenizer splits the grammar words {unsplit}")
    longest = max(all_prompts(world), key=lambda p: len(tok(p).input_ids))
    if len(tok(longest).input_ids) > TEXT_LENGTH:
        raise RuntimeError(f"the prompt {longest!r} is longer than TEXT_LENGTH = {TEXT_LENGTH} tokens")
    encoder = seeded(recipe.seed, 0, lambda: BUILDERS[recipe.encoder](recipe, tok))
    return {"tokenizer": tok, "text_encoder": encoder.requires_grad_(False).eval()}


def bert(recipe: VideoTextRecipe, tok):
    """A `BertModel` of the recipe's shape, with its pooler (unused: the Wan adapter reads the last hidden states;
    kept so that `from_pretrained` finds every weight it builds)."""
    from transformers import BertConfig, BertModel

    conf = BertConfig(vocab_size=len(tok), hidden_size=recipe.d_model, num_hidden_layers=recipe.num_layers,
                      num_attention_heads=recipe.num_heads, intermediate_size=recipe.d_ff,
                      max_position_embeddings=TEXT_LENGTH, type_vocab_size=1, pad_token_id=tok.pad_token_id)
    return BertModel(conf, add_pooling_layer=True)


def umt5(recipe: VideoTextRecipe, tok):
    """A `UMT5EncoderModel` of the recipe's shape (Wan's own text encoder family)."""
    from transformers import UMT5Config, UMT5EncoderModel

    conf = UMT5Config(vocab_size=len(tok), d_model=recipe.d_model, d_ff=recipe.d_ff,
                      d_kv=recipe.d_model // recipe.num_heads, num_heads=recipe.num_heads,
                      num_layers=recipe.num_layers, relative_attention_num_buckets=8,
                      relative_attention_max_distance=TEXT_LENGTH, feed_forward_proj="gated-gelu",
                      is_encoder_decoder=False, use_cache=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, decoder_start_token_id=0)
    return UMT5EncoderModel(conf)


#: the text encoders a recipe may name (`text.encoder`) and what builds each
BUILDERS = {"bert": bert, "umt5": umt5}
ENCODERS = tuple(BUILDERS)
