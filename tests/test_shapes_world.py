"""The shapes world: grammar, splits, scene sampler, renderer and the exact checker (GenEval's rules)."""

import collections
from dataclasses import replace

import numpy as np
import pytest

from omniroll.tasks.shapes.detect import connected_components, detect
from omniroll.tasks.shapes.grammar import TAGS, PromptError, all_prompts, grammar_words, parse_prompt
from omniroll.tasks.shapes.judge import fails_by_exclude, judge
from omniroll.tasks.shapes.render import render
from omniroll.tasks.shapes.report import Report, chance_prompt, score_pictures
from omniroll.tasks.shapes.scene import Scene, SceneObject, relations, sample_scene
from omniroll.tasks.shapes.splits import split_prompts
from omniroll.tasks.shapes.world import World


def test_grammar_covers_genevals_six_categories_with_their_metadata():
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) == 240
    tags = collections.Counter(parse_prompt(p).tag for p in prompts)
    assert tags == {"single_object": 3, "two_object": 6, "counting": 9, "colors": 18, "position": 24,
                    "color_attr": 180}
    assert parse_prompt("three squares").metadata() == {
        "tag": "counting", "include": [{"class": "square", "count": 3}], "prompt": "three squares",
        "exclude": [{"class": "square", "count": 4}]}
    assert parse_prompt("a circle left of a square").metadata() == {
        "tag": "position", "prompt": "a circle left of a square",
        "include": [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}]}
    assert parse_prompt("a red circle and a blue triangle").metadata()["include"] == [
        {"class": "circle", "count": 1, "color": "red"}, {"class": "triangle", "count": 1, "color": "blue"}]
    assert parse_prompt("  A Red Circle. ").prompt == "a red circle"  # case, spaces and a full stop are forgiven


def test_twin_wordings_share_one_requirement_and_others_do_not():
    key = lambda p: parse_prompt(p).key  # noqa: E731
    assert key("a circle and a square") == key("a square and a circle")
    assert key("a circle left of a square") == key("a square right of a circle")
    assert key("a circle above a square") == key("a square below a circle")
    assert key("a circle left of a square") != key("a square left of a circle")
    assert key("a red circle and a blue square") == key("a blue square and a red circle")
    assert key("a red circle and a blue square") != key("a blue circle and a red square")
    assert len({key(p) for p in all_prompts()}) == 3 + 3 + 9 + 18 + 12 + 90


@pytest.mark.parametrize("bad, nearest", [
    ("a red circel", "a red circle"), ("five circles", "four circles"), ("a dog", None),
    ("a circle left of a circle", None), ("a red circle and a red square", None), ("", None)])
def test_a_prompt_outside_the_grammar_is_refused_naming_the_nearest_valid_one(bad, nearest):
    with pytest.raises(PromptError) as e:
        parse_prompt(bad)
    assert repr(bad) in str(e.value) and e.value.nearest in all_prompts()
    if nearest is not None:
        assert e.value.nearest == nearest


def test_a_prompt_file_with_lines_outside_the_grammar_names_each_line_as_written(tmp_path):
    from omniroll.tasks.shapes.splits import prompts_of

    path = tmp_path / "prompts.txt"
    path.write_text("a red circle\r\n\na red circel\nthree squares\na dog\n")
    with pytest.raises(ValueError) as e:
        prompts_of(str(path))
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{path} line 3: ") and lines[1].startswith(f"{path} line 5: ")
    assert "'a red circel' is not" in lines[0] and "'a dog' is not" in lines[1]  # the prompt, not its line break
    path.write_text("a red circle\r\n\nthree squares\n")
    assert prompts_of(str(path)) == ["a red circle", "three squares"]


def test_every_grammar_word_is_a_word_of_the_prompts():
    words = grammar_words()
    assert {"circle", "squares", "left", "above", "purple", "four"} <= set(words)
    assert len(words) == len(set(words))


def test_splits_are_fixed_disjoint_and_keep_twins_and_vocabulary_together():
    train, held = split_prompts("train"), split_prompts("heldout")
    assert (len(train), len(held)) == (187, 53)
    assert set(train).isdisjoint(held) and sorted(train + held) == sorted(all_prompts())
    train_keys = {parse_prompt(p).key for p in train}
    assert not train_keys & {parse_prompt(p).key for p in held}  # twins fall on one side
    assert "a circle" in train and "a circle and a triangle" in held and "a triangle and a circle" in held
    held_tags = collections.Counter(parse_prompt(p).tag for p in held)
    assert set(held_tags) == set(TAGS) - {"single_object"}
    colours = [parse_prompt(p).include[0] for p in train if parse_prompt(p).tag == "colors"]
    world = World()
    assert {r.colour for r in colours} == set(world.colours) and {r.shape for r in colours} == set(world.shapes)


def test_scenes_are_seeded_hold_exactly_the_prompted_objects_and_never_touch():
    spec = parse_prompt("a red circle and a blue square")
    a = sample_scene(spec, np.random.default_rng(7))
    assert a == sample_scene(spec, np.random.default_rng(7)) != sample_scene(spec, np.random.default_rng(8))
    assert sorted((o.shape, o.colour) for o in a.objects) == [("circle", "red"), ("square", "blue")]
    world = World()
    rng = np.random.default_rng(0)
    for p in ["four triangles", "a circle left of a square", "a triangle below a circle"]:
        for _ in range(50):
            objs = sample_scene(parse_prompt(p), rng).objects
            assert all(world.margin <= v <= world.size - world.margin for o in objs for v in o.box)
            for i, x in enumerate(objs):
                for y in objs[i + 1:]:
                    gap_x = max(y.box[0] - x.box[2], x.box[0] - y.box[2])
                    gap_y = max(y.box[1] - x.box[3], x.box[1] - y.box[3])
                    assert max(gap_x, gap_y) >= world.gap


def test_position_scenes_stand_in_their_relation_and_in_no_other():
    rng = np.random.default_rng(1)
    for p in [q for q in all_prompts() if parse_prompt(q).tag == "position"]:
        spec = parse_prompt(p)
        for _ in range(10):
            target, mover = sample_scene(spec, rng).objects
            assert relations(mover.box, target.box) == {spec.include[1].position[0]}


def test_relations_follow_genevals_rule():
    box = lambda cx, cy, s=10: (cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2)  # noqa: E731
    assert relations(box(10, 30), box(40, 30)) == {"left of"}
    assert relations(box(40, 30), box(10, 30)) == {"right of"}
    assert relations(box(30, 10), box(30, 40)) == {"above"}
    assert relations(box(10, 10), box(40, 40)) == {"left of", "above"}  # diagonal: both
    assert relations(box(30, 30), box(31, 30)) == set()  # within 0.1 x (sum of widths): too close to say


@pytest.mark.parametrize("tag", TAGS)
def test_the_checker_passes_the_renderers_own_pictures_and_fails_contradicting_prompts(tag):
    rng = np.random.default_rng(abs(hash(tag)) % 2**32)
    prompts = [p for p in all_prompts() if parse_prompt(p).tag == tag]
    passed, wrong = [], []
    for i in range(150):
        spec = parse_prompt(prompts[i % len(prompts)])
        dets = detect(render(sample_scene(spec, rng)))
        passed.append(judge(spec, dets).strict)
        assert judge(spec, dets).partial == 1.0 and judge(spec, dets).continuous == 1.0
        assert not judge(spec, dets).extra  # a render holds exactly the prompted objects
        others = [q for q in prompts if parse_prompt(q).key != spec.key]
        wrong.append(judge(parse_prompt(others[int(rng.integers(len(others)))]), dets).strict)
    assert np.mean(passed) >= 0.99 and np.mean(wrong) <= 0.01


def _picture(*objects):
    return render(Scene(tuple(SceneObject(*o) for o in objects)))


def test_counting_is_exact_and_partial_credit_counts_the_shortfall():
    three = parse_prompt("three squares")
    two = _picture(("square", "red", 12, 12, 16), ("square", "blue", 40, 40, 16))
    four = _picture(("square", "red", 12, 12, 16), ("square", "blue", 40, 40, 16), ("square", "red", 12, 45, 16),
                    ("square", "green", 45, 12, 16))
    j2, j4 = judge(three, detect(two)), judge(three, detect(four))
    assert not j2.strict and j2.partial == pytest.approx(2 / 3)
    assert not j4.strict and j4.partial == pytest.approx(2 / 3)  # one too many costs as much as one too few
    assert j2.continuous == pytest.approx(2 / 3) and j4.continuous == pytest.approx(2 / 3)  # squares fit exactly
    assert judge(parse_prompt("four squares"), detect(four)).strict
    assert j4.extra and not j2.extra and not judge(parse_prompt("four squares"), detect(four)).extra
    # strict fails "three squares" drawn with four on GenEval's exclude rule, and with two on the count: the reasons
    # tell them apart (fails_by_exclude reads the reasons back, also from an evaluation's picture records)
    assert j4.reasons == ("expected square<4, found 4",) and fails_by_exclude(j4.reasons)
    assert j2.reasons == ("expected square>=3, found 2",) and not fails_by_exclude(j2.reasons)
    assert not fails_by_exclude(judge(parse_prompt("a blue square"), detect(two)).reasons + ("",))


def test_extra_objects_are_flagged_where_strict_allows_them_and_counted_in_the_report():
    """GenEval's two-object and single-object rules pass a picture with one object too many; the checker still says
    it shows more of a prompted shape than asked, and the report gives the share of such pictures."""
    two_squares = _picture(("square", "red", 12, 12, 16), ("square", "blue", 45, 45, 16))
    with_circle = _picture(("circle", "red", 12, 12, 16), ("square", "blue", 45, 45, 16))
    a_square = judge(parse_prompt("a square"), detect(two_squares))
    assert a_square.strict and a_square.extra and a_square.partial == 0.0  # the count term wants exactly one
    assert not judge(parse_prompt("a square"), detect(with_circle)).extra  # an unprompted shape is not counted
    assert not judge(parse_prompt("two squares"), detect(two_squares)).extra
    extra_pair = _picture(("circle", "red", 12, 12, 16), ("square", "blue", 45, 45, 16),
                          ("square", "green", 12, 45, 16))
    pair = judge(parse_prompt("a circle and a square"), detect(extra_pair))
    assert pair.strict and pair.extra
    rows = score_pictures(["a square", "a square", "two squares"], [two_squares, with_circle, two_squares])
    assert [r.extra for r in rows] == [True, False, False]
    report = Report.from_rows(rows)
    assert report.overall["extra_objects"] == pytest.approx(1 / 3) and "more of a prompted shape" in report.table()
    assert report.flat("eval/x")["eval/x/extra_objects"] == pytest.approx(1 / 3)
    assert "extra_objects" not in Report.from_rows([replace(r, extra=None) for r in rows]).overall


def test_colour_attribution_and_position_need_the_right_binding():
    pic = _picture(("circle", "red", 15, 32, 18), ("square", "blue", 48, 32, 18))
    assert judge(parse_prompt("a red circle and a blue square"), detect(pic)).strict
    swapped = judge(parse_prompt("a blue circle and a red square"), detect(pic))
    assert not swapped.strict and swapped.partial == 0.5  # both shapes there, both colours wrong
    assert judge(parse_prompt("a circle left of a square"), detect(pic)).strict
    assert judge(parse_prompt("a square right of a circle"), detect(pic)).strict
    above = judge(parse_prompt("a circle above a square"), detect(pic))
    assert not above.strict and above.partial == pytest.approx(2 / 3)
    assert judge(parse_prompt("a square"), detect(pic)).strict  # GenEval: at least one


def test_continuous_credit_grades_a_position_and_a_colour_that_partial_credit_scores_in_thirds():
    prompt = parse_prompt("a circle left of a square")
    cont, part = [], []
    for cx in (58, 46, 34, 22, 8):  # the circle above the square, moving from its right to its left
        j = judge(prompt, detect(_picture(("circle", "red", cx, 20, 14), ("square", "blue", 32, 44, 14))))
        cont.append(j.continuous)
        part.append(j.partial)
    assert part[:4] == [pytest.approx(2 / 3)] * 4 and part[-1] == 1.0  # a pass at the last place only
    assert all(a < b for a, b in zip(cont, cont[1:]))  # every step towards the relation earns more
    assert cont[0] > 0.0 and cont[-1] == 1.0

    blue = parse_prompt("a blue circle")
    pic = _picture(("circle", "red", 32, 32, 24))
    mask = (pic != pic[0, 0]).any(-1)
    rows = np.nonzero(mask.any(1))[0]
    shares, cont = [], []
    for k in (0, 3, 6, 8):  # repaint the circle's top k rows blue: still one blob, red while it holds >= 0.6
        p = pic.copy()
        top = mask.copy()
        top[rows[0] + k:] = False
        p[top] = (40, 80, 215)
        d = detect(p)
        assert len(d) == 1 and d[0].colour == "red"
        shares.append(d[0].share_of("blue"))
        j = judge(blue, d)
        assert not j.strict and j.partial == 0.5  # the circle is there, its colour is wrong
        cont.append(j.continuous)
    assert shares[0] == 0.0 and all(a < b for a, b in zip(shares, shares[1:]))
    assert all(a < b for a, b in zip(cont, cont[1:])) and cont[0] == 0.5


def test_an_empty_canvas_and_specks_earn_nothing():
    blank = render(Scene(()))
    assert detect(blank) == []
    assert judge(parse_prompt("a circle"), []).partial == 0.0
    assert judge(parse_prompt("a circle left of a square"), []).continuous == 0.0
    assert judge(parse_prompt("a red circle and a blue square"), []).continuous == 0.0
    specks = blank.copy()
    specks[10:13, 10:13] = (215, 35, 35)  # 9 red pixels: below min_area
    assert detect(specks) == []


def test_connected_components_match_a_flood_fill():
    rng = np.random.default_rng(3)
    for _ in range(30):
        mask = rng.random((24, 31)) < 0.45
        labels = connected_components(mask)
        seen = np.zeros_like(mask, dtype=bool)
        expected = []
        for r, c in zip(*np.nonzero(mask)):
            if seen[r, c]:
                continue
            comp, stack = set(), [(r, c)]
            seen[r, c] = True
            while stack:
                y, x = stack.pop()
                comp.add((y, x))
                for dy, dx in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                    yy, xx = y + dy, x + dx
                    if 0 <= yy < 24 and 0 <= xx < 31 and mask[yy, xx] and not seen[yy, xx]:
                        seen[yy, xx] = True
                        stack.append((yy, xx))
            expected.append(comp)
        got = {}
        for y, x in zip(*np.nonzero(labels)):
            got.setdefault(labels[y, x], set()).add((y, x))
        assert sorted(map(sorted, got.values())) == sorted(map(sorted, expected))
        assert ((labels > 0) == mask).all()


def test_report_tabulates_categories_and_a_chance_baseline_of_another_requirement():
    rng = np.random.default_rng(5)
    prompts = ["a circle", "three squares", "a red circle", "a circle left of a square"]
    pics = [render(sample_scene(parse_prompt(p), rng)) for p in prompts]
    rows = score_pictures(prompts, [p.transpose(2, 0, 1) for p in pics])  # the engine's CHW layout too
    rep = Report.from_rows(rows)
    assert rep.overall["strict"] == 1.0 and rep.overall["chance"] == 0.0 and rep.overall["n"] == 4
    assert set(rep.categories) == {"single_object", "counting", "colors", "position"}
    assert rep.flat("eval/train")["eval/train/counting/strict"] == 1.0
    for p in all_prompts():
        spec = parse_prompt(p)
        c = parse_prompt(chance_prompt(spec))
        assert c.tag == spec.tag and c.key != spec.key
