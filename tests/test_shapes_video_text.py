"""The shapes-video recipe's text encoder: it tells prompts of the same words in another order apart (Wan's
cross-attention reads the text without positions), and a recipe written before it names the encoder it had."""

import pytest
import torch


def word_order_ratios(encoder: str) -> dict:
    """Per word-order pair (an order or a change prompt and its twin; a two-motion prompt with its directions
    exchanged: the same words), the Chamfer distance between the two prompts' encoder outputs over the distance to
    another prompt of the category (20 prompts each)."""
    import random

    from omniroll.models.shapes_video.text import TEXT_LENGTH, VideoTextRecipe, build_text
    from omniroll.tasks.moving_shapes.grammar import all_prompts, parse_prompt, twin_prompt

    text = build_text(VideoTextRecipe(encoder=encoder))

    def token_sets(prompts):
        t = text["tokenizer"](prompts, padding="max_length", max_length=TEXT_LENGTH, return_tensors="pt")
        with torch.no_grad():
            h = text["text_encoder"](t.input_ids, t.attention_mask).last_hidden_state
        return [h[i, : int(t.attention_mask[i].sum())] for i in range(len(prompts))]

    def chamfer(a, b):
        d = torch.cdist(a, b)
        return float(d.min(1).values.mean() + d.min(0).values.mean())

    def swapped(p):  # "a X moving down and a Y moving left" -> "a X moving left and a Y moving down"
        first, _, second = p.partition(" and ")
        (a, da), (b, db) = first.rsplit(" ", 1), second.rsplit(" ", 1)
        return f"{a} {db} and {b} {da}" if da != db else None

    rng, out = random.Random(0), {}
    for tag, pair in (("order", twin_prompt), ("change", twin_prompt), ("two_motions", swapped)):
        prompts = [p for p in all_prompts() if parse_prompt(p).tag == tag]
        chosen = [(p, pair(p)) for p in rng.sample(prompts, 30) if pair(p) is not None][:20]
        for p, q in chosen:
            assert sorted(p.replace(",", "").split()) == sorted(q.replace(",", "").split()) and p != q
        others = [rng.choice([o for o in prompts if o not in (p, q)]) for p, q in chosen]
        a, b, c = (token_sets(x) for x in ([p for p, _ in chosen], [q for _, q in chosen], others))
        out[tag] = sum(map(chamfer, a, b)) / sum(map(chamfer, a, c))
    return out


def test_the_recipes_text_encoder_tells_prompts_of_the_same_words_apart_where_wans_umt5_hardly_does():
    # the transformer cross-attends to the text without positions: it reads a set of vectors, so prompts of the same
    # words in another order are told apart only by what the encoder writes into each vector (measured: a random UMT5
    # 0.08-0.21 of another prompt's distance, a random BERT 0.61-1.30; docs/moving_shapes.md)
    from omniroll.models.shapes_video.recipe import FULL

    assert FULL.text.encoder == "bert"
    bert, umt5 = word_order_ratios("bert"), word_order_ratios("umt5")
    assert min(bert.values()) > 0.45, bert
    assert max(umt5.values()) < 0.25, umt5


def test_a_recipe_json_from_before_the_bert_is_the_umt5_and_an_unknown_encoder_is_refused():
    from omniroll.models.shapes_video.recipe import FULL, ShapesVideoRecipe

    old = FULL.to_dict()
    del old["text"]["encoder"]
    assert ShapesVideoRecipe.from_dict(old).text.encoder == "umt5"
    assert ShapesVideoRecipe.from_dict(FULL.to_dict()) == FULL
    with pytest.raises(ValueError, match=r"text.encoder must be one of \['bert', 'umt5'\], got 'clip'"):
        ShapesVideoRecipe.from_dict({**FULL.to_dict(), "text": {**FULL.to_dict()["text"], "encoder": "clip"}})
    with pytest.raises(ValueError, match="text.num_heads must be an int >= 1 dividing text.d_model = 32"):
        ShapesVideoRecipe.from_dict({**FULL.to_dict(), "text": {**FULL.to_dict()["text"], "num_heads": 5}})
