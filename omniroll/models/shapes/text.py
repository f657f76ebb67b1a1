"""The shapes model's text side: tokenizers that know every grammar word as one token, and small frozen random text
encoders (two CLIPs and a T5, as SD3 has) whose outputs the transformer learns to read.

The encoders are never trained: their weights are drawn from a seed, as the tiny models' are, and the transformer
learns to read their (distinct, fixed) embeddings of the grammar's words. `TEXT_LENGTH` tokens cover the longest
prompt with its special tokens, for both the CLIP context and T5's `max_sequence_length`.
"""

from __future__ import annotations

from dataclasses import dataclass


from omniroll.models.tiny._common import build_t5_tokenizer, seeded, train_clip_tokenizer
from omniroll.tasks.shapes.grammar import grammar_words
from omniroll.tasks.shapes.world import DEFAULT_WORLD, World

#: CLIP context and T5 `max_sequence_length` of the shapes model (the longest prompt is 7 words + 2 special tokens)
TEXT_LENGTH = 12


@dataclass(frozen=True)
class TextRecipe:
    clip_hidden: int = 32
    clip_layers: int = 2
    clip_heads: int = 2
    clip_projection: int = 32
    t5_d_model: int = 64
    t5_layers: int = 2
    t5_heads: int = 4
    seed: int = 2


def build_text_stack(recipe: TextRecipe, world: World = DEFAULT_WORLD) -> dict:
    """{tokenizer, tokenizer_2, tokenizer_3, text_encoder, text_encoder_2, text_encoder_3}, weights from
    `recipe.seed`."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    words = tuple(grammar_words(world))
    tok = train_clip_tokenizer(words, max_length=TEXT_LENGTH)
    tok_2 = train_clip_tokenizer(words, max_length=TEXT_LENGTH)
    tok_3 = build_t5_tokenizer(words, max_length=TEXT_LENGTH)
    unsplit = [w for w in words if len(tok(w, add_special_tokens=False).input_ids) != 1
               or len(tok_3(w, add_special_tokens=False).input_ids) != 1]
    if unsplit:
        raise RuntimeError(f"the shapes tokenizers split the grammar words {unsplit}")

    def clip(index: int):
        conf = CLIPTextConfig(
            vocab_size=len(tok), max_position_embeddings=TEXT_LENGTH, hidden_act="gelu",
            hidden_size=recipe.clip_hidden, intermediate_size=2 * recipe.clip_hidden,
            projection_dim=recipe.clip_projection, num_hidden_layers=recipe.clip_layers,
            num_attention_heads=recipe.clip_heads, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id)
        return seeded(recipe.seed, index, lambda: CLIPTextModelWithProjection(conf))

    t5 = T5Config(vocab_size=len(tok_3), d_model=recipe.t5_d_model, d_kv=recipe.t5_d_model // recipe.t5_heads,
                  d_ff=2 * recipe.t5_d_model, num_layers=recipe.t5_layers, num_heads=recipe.t5_heads,
                  relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                  relative_attention_max_distance=TEXT_LENGTH, pad_token_id=tok_3.pad_token_id,
                  eos_token_id=tok_3.eos_token_id, decoder_start_token_id=0, is_encoder_decoder=False,
                  use_cache=False)
    encoders = {"text_encoder": clip(0), "text_encoder_2": clip(1),
                "text_encoder_3": seeded(recipe.seed, 2, lambda: T5EncoderModel(t5))}
    for m in encoders.values():
        m.requires_grad_(False)
    return {"tokenizer": tok, "tokenizer_2": tok_2, "tokenizer_3": tok_3, **encoders}


def joint_attention_dim(recipe: TextRecipe) -> int:
    if 2 * recipe.clip_hidden > recipe.t5_d_model:
        raise ValueError("SD3 pads the two CLIPs' hidden states to T5's width: 2 x clip_hidden must be <= t5_d_model")
    return recipe.t5_d_model


def pooled_dim(recipe: TextRecipe) -> int:
    return 2 * recipe.clip_projection


__all__ = ["TEXT_LENGTH", "TextRecipe", "build_text_stack", "joint_attention_dim", "pooled_dim"]
