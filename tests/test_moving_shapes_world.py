"""The moving-shapes world: grammar, twins, splits, scene sampler, renderer, tracker and the exact clip checker,
against the renderer's own clips and the cheats (reversed, shuffled, frozen)."""

import collections
import re

import numpy as np
import pytest

from omniroll.tasks.moving_shapes.cheats import CHEATS, apply_order, cheat_order, shuffled_order
from omniroll.tasks.moving_shapes.grammar import (
    TAGS, PromptError, all_prompts, all_specs, check_prompts, grammar_words, parse_prompt, twin_prompt, twin_spec)
from omniroll.tasks.moving_shapes.judge import detect_frames, frames_hwc, judge_clip, score_clip
from omniroll.tasks.moving_shapes.render import prompt_scene, render_clip, render_prompt
from omniroll.tasks.moving_shapes.scene import FIRST_LEFT_GAP, sample_clip_scene
from omniroll.tasks.moving_shapes.splits import is_heldout, split_prompts
from omniroll.tasks.moving_shapes.track import Track, TrackerSettings, track
from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD, MovingWorld
from omniroll.tasks.shapes.detect import Detection

#: shuffles drawn per clip (the shuffle is cheap to judge: the clip's frames are detected once)
SHUFFLES = 10


@pytest.fixture(scope="module")
def rendered():
    """Every prompt of the grammar rendered once (seeded), with each frame's detections: 72 to 180 clips per
    category."""
    rng = np.random.default_rng(20261202)
    out = []
    for spec in all_specs():
        clip = render_clip(sample_clip_scene(spec, rng))
        out.append((spec, clip, detect_frames(clip)))
    return out


def by_tag(rows):
    groups = collections.defaultdict(list)
    for row in rows:
        groups[row[0].tag].append(row)
    return groups


# ------------------------------------------------------------------------------------------------ grammar and twins
def test_grammar_has_four_temporal_categories_in_canonical_form():
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) == 438
    tags = collections.Counter(parse_prompt(p).tag for p in prompts)
    assert tags == {"direction": 72, "two_motions": 96, "order": 180, "change": 90} and tuple(tags) == TAGS
    assert all(parse_prompt(p).prompt == p for p in prompts)  # every prompt is its own canonical form
    spec = parse_prompt("  A Red Circle appears then a Blue Square. ")  # case, spaces, comma and full stop forgiven
    assert spec.prompt == "a red circle appears, then a blue square" and spec.tag == "order"
    assert [(a.shape, a.colour) for a in spec.actors] == [("circle", "red"), ("square", "blue")]
    assert parse_prompt("a square moving up and a triangle moving down").metadata() == {
        "tag": "two_motions", "prompt": "a square moving up and a triangle moving down",
        "actors": [{"shape": "square", "direction": "up"}, {"shape": "triangle", "direction": "down"}]}
    change = parse_prompt("a square turning from blue to green").actors[0]
    assert (change.shape, change.colour, change.becomes) == ("square", "blue", "green")
    key = lambda p: parse_prompt(p).key  # noqa: E731
    assert key("a circle moving up and a square moving left") == key("a square moving left and a circle moving up")
    assert key("a circle moving up and a square moving left") != key("a circle moving left and a square moving up")
    assert len({key(p) for p in prompts}) == 72 + 48 + 180 + 90
    assert {"moving", "appears", "then", "turning", "from", "to", "left", "down", "purple"} <= set(grammar_words())


@pytest.mark.parametrize("bad, nearest, reason", [
    ("a red circel moving left", "a red circle moving left", None),
    ("a red circle moving sideways", None, None),
    ("a circle moving left and a circle moving up", None, "different shapes"),
    ("a red circle appears, then a red square", None, "differ in shape and in colour"),
    ("a square turning from blue to blue", None, "colours must differ"),
    ("a red circle", None, None), ("", None, None)])
def test_a_prompt_outside_the_grammar_is_refused_naming_the_nearest_valid_one(bad, nearest, reason):
    with pytest.raises(PromptError) as e:
        parse_prompt(bad)
    assert repr(bad) in str(e.value) and e.value.nearest in all_prompts()
    assert "nearest valid prompt is" in str(e.value)
    if nearest is not None:
        assert e.value.nearest == nearest
    if reason is not None:
        assert reason in str(e.value)
    lines = check_prompts(["a red circle moving left", bad, 3])
    assert len(lines) == 2 and lines[0].startswith("prompt 1: ") and lines[1].startswith("prompt 2: ")


def test_every_prompt_has_an_antithetic_twin_with_the_same_objects():
    assert twin_prompt("a red circle moving left") == "a red circle moving right"
    assert twin_prompt("a square moving up and a triangle moving left") == \
        "a square moving down and a triangle moving right"
    assert twin_prompt("a red circle appears, then a blue square") == "a blue square appears, then a red circle"
    assert twin_prompt("a square turning from blue to green") == "a square turning from green to blue"
    for spec in all_specs():
        twin = twin_spec(spec)
        assert twin.prompt != spec.prompt and twin.tag == spec.tag and twin_spec(twin) == spec
        # the same objects (what the first frame of a direction / two-motion clip shows, what an order clip's end
        # shows; a change's colours swapped)
        assert sorted((a.shape, {a.colour, a.becomes}) for a in twin.actors) == \
            sorted((a.shape, {a.colour, a.becomes}) for a in spec.actors)


# ------------------------------------------------------------------------------------------------ splits
def test_splits_are_fixed_disjoint_and_hold_out_whole_combinations():
    train, held = split_prompts("train"), split_prompts("heldout")
    assert (len(train), len(held)) == (346, 92)
    assert set(train).isdisjoint(held) and sorted(train + held) == sorted(all_prompts())
    words = lambda ps: {w for p in ps for w in re.findall("[a-z]+", p)}  # noqa: E731
    assert words(train) == set(grammar_words())  # every word is seen in training: only combinations are new
    specs = [parse_prompt(p) for p in all_prompts()]
    # a held-out shape + direction pair is held out in every colour, and never moves in a training direction prompt
    pairs = lambda hold: {(s.actors[0].shape, s.actors[0].direction) for s in specs  # noqa: E731
                          if s.tag == "direction" and is_heldout(s) == hold}
    assert pairs(True) == {("circle", "down"), ("square", "up"), ("triangle", "right")}
    assert pairs(True).isdisjoint(pairs(False))
    # a held-out colour change is held out for every shape
    changes = lambda hold: {(s.actors[0].colour, s.actors[0].becomes) for s in specs  # noqa: E731
                            if s.tag == "change" and is_heldout(s) == hold}
    assert len(changes(True)) == 6 and changes(True).isdisjoint(changes(False))
    # both wordings of a requirement fall on the same side
    sides = collections.defaultdict(set)
    for s in specs:
        sides[s.key].add(is_heldout(s))
    assert all(len(v) == 1 for v in sides.values())
    assert collections.Counter(s.tag for s in specs if is_heldout(s)) == {
        "direction": 18, "two_motions": 20, "order": 36, "change": 18}
    with pytest.raises(ValueError, match="split must be one of"):
        split_prompts("test")


@pytest.mark.parametrize("name, split", [("eval_train", "train"), ("eval_heldout", "heldout"),
                                         ("two_motions_train", "train"), ("two_motions_heldout", "heldout")])
def test_the_shipped_prompt_files_hold_prompts_of_their_split_once_each(name, split):
    from pathlib import Path

    lines = (Path(__file__).parent.parent / "examples" / f"shapes_video_{name}.txt").read_text().splitlines()
    assert lines and len(set(lines)) == len(lines) and set(lines) <= set(split_prompts(split))
    if name.startswith("two_motions"):
        assert {parse_prompt(p).tag for p in lines} == {"two_motions"}


# ------------------------------------------------------------------------------------------------ the renderer
def test_rendering_is_deterministic_by_seed_and_in_the_video_sample_layout():
    a, b = render_prompt("a red circle moving left", 7), render_prompt("a red circle moving left", 7)
    assert a.dtype == np.uint8 and a.shape == (9, 3, 64, 64) and a.flags["C_CONTIGUOUS"]
    assert np.array_equal(a, b)
    assert not np.array_equal(a, render_prompt("a red circle moving left", 8))
    order = render_prompt("a red circle appears, then a blue square", 0)
    assert (order[0] == order[0, :, :1, :1]).all()  # an order clip opens on the empty background


def test_the_world_refuses_moves_and_timings_it_cannot_draw():
    with pytest.raises(ValueError, match="max_move"):
        MovingWorld(max_move=60)
    with pytest.raises(ValueError, match="opposite"):
        MovingWorld(directions=("left", "up"))
    with pytest.raises(ValueError, match="change_frames"):
        MovingWorld(change_frames=(7,))
    with pytest.raises(ValueError, match="appear"):
        MovingWorld(appear_frames=(0, 1))
    seven = MovingWorld(frames=7, appear_frames=(1,), appear_gap=(2, 3), change_frames=(3, 4))
    spec = parse_prompt("a red circle moving up", seven)
    clip = render_clip(sample_clip_scene(spec, np.random.default_rng(0), seven), seven)
    assert clip.shape == (7, 3, 64, 64) and score_clip(spec, clip, seven).strict


def test_a_two_motion_scene_can_put_its_first_named_object_left_and_other_scenes_ignore_the_layout():
    prompts = [p for p in all_prompts() if parse_prompt(p).tag == "two_motions"]
    passed, sides, kept = [], collections.Counter(), 0

    def middles(scene):
        return [(o.start[0] + o.end[0]) / 2 for o in scene.objects]

    for i, p in enumerate(prompts):
        scene, world = prompt_scene(p, 500 + i, layout="first_left"), prompt_scene(p, 500 + i)
        a, b = middles(scene)
        assert b - a >= FIRST_LEFT_GAP and scene == prompt_scene(p, 500 + i, layout="first_left"), p
        wa, wb = middles(world)
        sides["first left" if wb - wa >= FIRST_LEFT_GAP else "not"] += 1
        kept += scene == world  # a world's draw that follows the convention is kept as it is
        assert (scene == world) == (wb - wa >= FIRST_LEFT_GAP), p
        passed.append(score_clip(parse_prompt(p), render_clip(scene)).strict)
    assert np.mean(passed) >= 0.99  # the checker asks nothing of where the objects are
    assert sides["first left"] > 0.2 * len(prompts) and sides["not"] > 0.2 * len(prompts)  # the world: either side
    assert kept == sides["first left"]
    for p in ("a red circle moving left", "a red circle appears, then a blue square",
              "a square turning from red to green"):
        assert prompt_scene(p, 3, layout="first_left") == prompt_scene(p, 3)
    with pytest.raises(ValueError, match=r"layout must be one of \['any', 'first_left'\], got 'left'"):
        render_prompt(prompts[0], 0, layout="left")


# ------------------------------------------------------------------------------------------------ the checker
def test_the_checker_passes_the_renderers_clips_of_every_prompt_with_full_credit(rendered):
    """parse(render(prompt)) round-trips: every prompt of both splits, rendered, passes its own prompt."""
    for tag, rows in by_tag(rendered).items():
        judged = [judge_clip(spec, dets) for spec, _, dets in rows]
        passed = [j.strict for j in judged]
        assert np.mean(passed) >= 0.99, (tag, [(r[0].prompt, j.reasons) for r, j in zip(rows, judged)
                                               if not j.strict][:5])
        assert all(j.partial == 1.0 and j.continuous == 1.0 and not j.reasons for j in judged if j.strict)
        motion = np.mean([j.motion for j in judged])
        if tag in ("direction", "two_motions"):  # the motion meter reads the world's travel (24-40 px)
            assert DEFAULT_MOVING_WORLD.min_move - 1 <= motion <= DEFAULT_MOVING_WORLD.max_move + 1, (tag, motion)
        else:
            assert motion < 1.0, (tag, motion)


@pytest.mark.parametrize("cheat", CHEATS)
def test_the_checker_refuses_the_clips_reversed_shuffled_or_frozen(rendered, cheat):
    rng = np.random.default_rng(1)
    for tag, rows in by_tag(rendered).items():
        draws = SHUFFLES if cheat == "shuffled" else 1
        judged = [judge_clip(spec, [dets[k] for k in cheat_order(cheat, len(dets), rng)])
                  for spec, _, dets in rows for _ in range(draws)]
        assert np.mean([j.strict for j in judged]) <= 0.01, (tag, cheat)
        if cheat == "frozen":
            assert all(j.motion == 0.0 for j in judged)  # the motion meter reads a static clip as 0
        if cheat == "reversed" and tag == "direction":  # the right object, going the wrong way: partial credit
            assert all(j.partial == pytest.approx(2 / 3) for j in judged)


def test_a_cheat_is_the_clips_own_frames_so_judging_reordered_detections_is_judging_the_cheat(rendered):
    for rows in by_tag(rendered).values():
        spec, clip, dets = rows[0]
        for cheat in CHEATS:
            order = cheat_order(cheat, len(clip), np.random.default_rng(3))
            assert score_clip(spec, apply_order(clip, order)) == judge_clip(spec, [dets[k] for k in order])
    # a clip the checker passes fails its twin
    for spec, _, dets in rendered:
        if judge_clip(spec, dets).strict:
            assert not judge_clip(twin_spec(spec), dets).strict, spec.prompt


def test_the_shuffle_is_a_seeded_derangement_that_breaks_monotonicity():
    a = [shuffled_order(9, np.random.default_rng(5)).tolist() for _ in range(2)]
    assert a[0] == a[1]
    rng = np.random.default_rng(0)
    for _ in range(200):
        order = shuffled_order(9, rng)
        assert sorted(order) == list(range(9)) and (order != np.arange(9)).all()
        forward = int((np.diff(order) > 0).sum())
        assert 3 <= forward <= 5 and (order[:3] >= 6).any()
    with pytest.raises(ValueError, match="rng"):
        cheat_order("shuffled", 9)
    with pytest.raises(ValueError, match="cheat must be one of"):
        cheat_order("mirrored", 9)


def test_an_image_or_a_wrong_layout_is_not_a_clip():
    with pytest.raises(ValueError, match=r"\[T, 3, H, W\]"):
        frames_hwc(np.zeros((3, 64, 64), np.uint8))
    clip = render_prompt("a square turning from blue to green", 0)
    assert np.array_equal(frames_hwc(clip), clip.transpose(0, 2, 3, 1))
    spec = parse_prompt("a square turning from blue to green")
    assert score_clip(spec, clip.transpose(0, 2, 3, 1)) == score_clip(spec, clip)  # [T, H, W, 3] reads the same


def _det(x: float, y: float, shape: str = "circle", colour: str = "red") -> Detection:
    return Detection(shape, colour, (int(x) - 6, int(y) - 6, int(x) + 6, int(y) + 6), 100, 0.9, 1.0,
                     ((colour, 1.0),))


def test_the_tracker_links_objects_across_frames_bridges_a_missed_frame_and_splits_a_jump():
    frames = [[_det(10, 10), _det(50, 50, "square")], [_det(14, 10), _det(50, 46, "square")],
              [_det(50, 42, "square")], [_det(22, 10), _det(50, 38, "square")]]
    tracks = track(frames)
    assert [(t.frames, t.shape) for t in tracks] == [([0, 1, 3], "circle"), ([0, 1, 2, 3], "square")]
    assert tracks[0].displacement() == 12.0
    jumped = track([[_det(10, 10)], [_det(40, 10)]], TrackerSettings(max_jump=16))
    assert [t.frames for t in jumped] == [[0], [1]]
    assert Track([0, 1, 2], [_det(0, 0), _det(0, 0, "square"), _det(0, 0, "square")]).shape == "square"
    assert Track([0, 1], [_det(0, 0), _det(0, 0, "square")]).shape is None  # no majority


def test_the_rules_name_what_fails():
    clip = render_prompt("a red circle moving left", 3)
    j = score_clip(parse_prompt("a blue circle moving up"), clip)
    assert not j.strict and j.partial == pytest.approx(1 / 3)
    assert any("is red, expected blue" in r for r in j.reasons) and any("moved" in r for r in j.reasons)
    j = score_clip(parse_prompt("a square turning from blue to green"), render_prompt(
        "a square turning from green to blue", 3))
    assert not j.strict and any("starts green, expected blue" in r for r in j.reasons)
    assert 0 < j.continuous < 1


def test_an_object_that_vanishes_and_comes_back_has_not_stayed_since_it_appeared():
    spec = parse_prompt("a red circle appears, then a blue square")
    circle, square = _det(20, 20, "circle", "red"), _det(45, 45, "square", "blue")
    stays = [[], [circle], [circle], [circle, square], [circle, square], [circle, square]]
    assert judge_clip(spec, stays).strict
    # the circle is seen at frame 1, gone at 2, back at 3: its longest track starts at 3, but it appeared at 1
    back = [[], [circle], [], [circle], [circle, square], [circle, square]]
    j = judge_clip(spec, back)
    assert not j.strict and j.reasons == ("the circle does not stay to the end",)
    assert not judge_clip(spec, [[], [square], [square], [circle, square], [circle, square], [circle, square]]).strict


def test_a_prompt_file_is_read_in_canonical_form_and_lines_outside_the_grammar_are_named(tmp_path):
    from omniroll.tasks.moving_shapes.splits import prompts_of

    path = tmp_path / "prompts.txt"
    path.write_text("A red circle appears then a blue square.\r\n\na red circel moving left\na dog\n")
    with pytest.raises(ValueError) as e:
        prompts_of(str(path))
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{path} line 3: ") and lines[1].startswith(f"{path} line 4: ")
    assert "nearest valid prompt is 'a red circle moving left'" in lines[0]
    path.write_text("A red circle appears then a blue square.\n")
    assert prompts_of(str(path)) == ["a red circle appears, then a blue square"]
    assert prompts_of("heldout") == split_prompts("heldout")
    with pytest.raises(FileNotFoundError, match="train"):
        prompts_of(str(tmp_path / "missing.txt"))


def test_a_clip_with_an_object_its_prompt_does_not_name_passes_the_rules_and_is_counted_extra(rendered):
    """The renderer's clips never show an extra object; a clip of "a red circle moving left" with a blue square
    moving up pasted in (no overlap) passes its prompt's rules and is flagged `extra`, and a report counts it."""
    from omniroll.evaluation.worlds import WORLDS
    from omniroll.tasks.moving_shapes.report import score_clips
    from omniroll.tasks.shapes.report import Report

    assert not any(judge_clip(spec, dets).extra for spec, _, dets in rendered)
    prompt = "a red circle moving left"
    alone, other = frames_hwc(render_prompt(prompt, 2)), frames_hwc(render_prompt("a blue square moving up", 102))
    background = alone[0, 0, 0]
    mine, theirs = (alone != background).any(-1), (other != background).any(-1)
    assert (mine & theirs).sum() <= 4  # the two objects do not meet
    both = alone.copy()
    both[theirs & ~mine] = other[theirs & ~mine]
    alone_j, both_j = score_clip(parse_prompt(prompt), alone), score_clip(parse_prompt(prompt), both)
    assert alone_j.strict and not alone_j.extra
    assert both_j.strict and both_j.extra  # the rules find the circle; only `extra` sees the square
    rows = score_clips([prompt, prompt, prompt], [alone, both, alone])
    assert [r.extra for r in rows] == [False, True, False]
    world = WORLDS["moving_shapes"]
    report = Report.from_rows(rows, world.tags, world.extra_label)
    assert report.overall["extra_objects"] == pytest.approx(1 / 3)
    assert "clips with more objects than the prompt names: 33.3 %" in report.table()
