"""The evaluation cache (omniroll/evaluation/cache.py): an entry reads back bitwise and a damaged or foreign one is a
miss; the weights' digest (omniroll/weights/digest.py) sees exactly the weights a picture is drawn with; the trainer
reads its evaluation before training back from the cache only after the pictures it draws again match, and draws
it whole, replacing the entry, when they do not (the shapes model, a real Ray replica); `omniroll eval` reads a model
evaluated as it is from the cache too."""

import json
import os

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from PIL import Image

from omniroll.config import load_config
from omniroll.engine.engine import DiffusionEngine
from omniroll.evaluation.cache import (COLUMNS, EvaluationCache, check_indices, cpu_kernels, eligible, entry_key,
                                       evaluate_kept, picture_digest)
from omniroll.evaluation.shapes import eval_seed, scored
from omniroll.weights import WeightSender


def pictures(n, seed=0, size=8):
    return [np.random.default_rng(seed + i).integers(0, 256, (size, size, 3), dtype=np.uint8) for i in range(n)]


def test_an_entry_reads_back_bitwise_and_a_damaged_or_foreign_entry_is_a_miss(tmp_path):
    cache = EvaluationCache(tmp_path)
    pics = pictures(COLUMNS + 5)  # two rows of pictures.png, the second one short
    prompts, seeds = [f"p{i % 7}" for i in range(len(pics))], list(range(100, 100 + len(pics)))
    key = entry_key({"weights": "w"}, {"guidance_scale": 1.0}, prompts, seeds)
    assert cache.load(key, prompts, seeds) is None  # nothing yet
    path = cache.store(key, {"identity": {"weights": "w"}}, prompts, seeds, pics)
    back, folder = cache.load(key, prompts, seeds)
    assert folder == path and all(np.array_equal(a, b) and a.dtype == np.uint8 for a, b in zip(pics, back))
    assert cache.load(key, prompts[:-1], seeds[:-1]) is None  # another picture list under the key
    assert cache.load(key, prompts, [s + 1 for s in seeds]) is None

    # an entry.json that is not one is a miss, not an error
    good = (path / "entry.json").read_text()
    for bad in ("{", "[]", '{"pictures": [{"prompt": "p0"}]}'):
        (path / "entry.json").write_text(bad)
        assert cache.load(key, prompts, seeds) is None
    (path / "entry.json").write_text(good)

    # one pixel of one picture changed on disk: its digest no longer matches, so the entry is a miss
    atlas = np.asarray(Image.open(path / "pictures.png")).copy()
    atlas[8 * 1 + 3, 8 * 2 + 4, 0] ^= 1  # picture COLUMNS + 2 (second row, third column)
    Image.fromarray(atlas).save(path / "pictures.png")
    assert cache.load(key, prompts, seeds) is None

    # a model's shipped entries are read after the root, never written
    shipped = EvaluationCache(tmp_path / "user", read_only=[tmp_path / "model" / "evaluations"])
    EvaluationCache(tmp_path / "model" / "evaluations").store(key, {}, prompts, seeds, pics)
    assert shipped.load(key, prompts, seeds)[1] == tmp_path / "model" / "evaluations" / key
    assert shipped.store(key, {}, prompts, seeds, pics) == tmp_path / "user" / key
    assert shipped.load(key, prompts, seeds)[1] == tmp_path / "user" / key

    # a bounded root: writing an entry removes the least recently used ones beyond max_bytes (a read counts as a use)
    small = EvaluationCache(tmp_path / "small", max_bytes=1)
    keys = [entry_key({"n": i}, {}, prompts, seeds) for i in range(3)]
    small.store(keys[0], {}, prompts, seeds, pics)
    os.utime(tmp_path / "small" / keys[0] / "entry.json", (1, 1))
    small.store(keys[1], {}, prompts, seeds, pics)  # over the cap: the older entry goes, the new one stays
    assert sorted(p.name for p in (tmp_path / "small").iterdir()) == [keys[1]]
    one = sum(f.stat().st_size for f in (tmp_path / "small" / keys[1]).iterdir())
    roomy = EvaluationCache(tmp_path / "small", max_bytes=5 * one // 2)  # room for two entries
    roomy.store(keys[0], {}, prompts, seeds, pics)
    os.utime(tmp_path / "small" / keys[0] / "entry.json", (1, 1))
    os.utime(tmp_path / "small" / keys[1] / "entry.json", (2, 2))
    assert roomy.load(keys[0], prompts, seeds) is not None  # read: now the most recently used
    roomy.store(keys[2], {}, prompts, seeds, pics)
    assert sorted(p.name for p in (tmp_path / "small").iterdir()) == sorted([keys[0], keys[2]])

    # every part of the key counts
    others = [entry_key({"weights": "v"}, {"guidance_scale": 1.0}, prompts, seeds),
              entry_key({"weights": "w"}, {"guidance_scale": 4.5}, prompts, seeds),
              entry_key({"weights": "w"}, {"guidance_scale": 1.0}, prompts, seeds[::-1])]
    assert len({key, *others}) == 4

    # what is drawn again: spread over the prompts, the first and the last included; all of a short list
    assert check_indices(37) == [0, 5, 10, 15, 21, 26, 31, 36]
    assert check_indices(5) == [0, 1, 2, 3, 4]
    # only replicas that agree and draw batch-invariantly share an entry
    same = {"weights": "w", "execution": {"batch_invariant": True}}
    assert eligible([same, dict(same)]) == same
    assert eligible([same, {**same, "weights": "v"}]) is None
    assert eligible([{**same, "execution": {"batch_invariant": False}}]) is None
    assert eligible([]) is None


def rendered(prompts, seeds):
    """A picture of each prompt drawn by the shapes world's renderer (what the prompt asks: its verdict is a pass)."""
    from omniroll.tasks.shapes.grammar import parse_prompt
    from omniroll.tasks.shapes.render import render
    from omniroll.tasks.shapes.scene import sample_scene

    return [render(sample_scene(parse_prompt(p), np.random.default_rng(s))) for p, s in zip(prompts, seeds)]


def test_an_entry_from_another_machine_is_read_when_its_pictures_agree_in_verdicts_not_when_they_show_other_things(
        tmp_path):
    # the shipped entry was drawn on a machine whose CPU kernels give other last bits: the pictures drawn here differ
    # from it by a level here and there, with the same verdicts; the evaluation is read, not drawn whole. A picture
    # that shows something else (another verdict, or the same verdict on another picture) is never paired with it.
    prompts = ["a red circle", "two squares", "a blue triangle", "a circle", "three triangles", "a green square",
               "a yellow circle", "a black square", "a purple triangle", "two circles"]
    seeds = 3
    order = [(p, eval_seed(7, p, j)) for p in prompts for j in range(seeds)]
    names, numbers = [p for p, _ in order], [s for _, s in order]
    here = rendered(names, numbers)  # what this machine draws
    ev_here = scored(here, names, numbers)
    assert all(r["strict"] for r in ev_here.picture_records())
    identity, sampling = {"weights": "w", "execution": {"batch_invariant": True}}, {"guidance_scale": 1.0}
    key = entry_key(identity, sampling, names, numbers)

    def entry_with(change):
        """The shipped entry: this machine's pictures, `change(index, picture)` applied (digests written anew, so
        the entry itself is sound)."""
        root = tmp_path / f"shipped-{len(list(tmp_path.iterdir()))}"
        other = [change(i, p.copy()) for i, p in enumerate(here)]
        EvaluationCache(root).store(key, {}, names, numbers, other)
        return EvaluationCache(tmp_path / "user", read_only=[root]), other

    asked = []

    def draw(indices, n):
        asked.append(indices)
        chosen = range(len(prompts)) if indices is None else indices
        idx = [i * seeds + j for i in chosen for j in range(n)]
        return scored([here[k] for k in idx], [names[k] for k in idx], [numbers[k] for k in idx])

    def last_bits(i, p):  # 1 in 16 pixels one level up or down: what another CPU's arithmetic leaves
        rng = np.random.default_rng(i)
        step = rng.choice([-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], size=p.shape)
        return np.clip(p.astype(int) + step, 0, 255).astype(np.uint8)

    # 1. other last bits, the same verdicts: read (only the check pictures drawn), the stored pictures used
    cache, other = entry_with(last_bits)
    assert not any(np.array_equal(a, b) for a, b in zip(other, here))
    ev, info = evaluate_kept(cache, identity, sampling, prompts, seeds, 7, draw)
    assert asked == [check_indices(len(prompts))]
    assert info["read"] and info["agreed"] == "verdicts" and info["checked"] == 8
    assert "other last bits" in info["note"] and "every verdict the same" in info["note"]
    assert f"drawn on an unrecorded CPU, here {cpu_kernels()}" in info["note"]
    assert all(np.array_equal(a, b) for a, b in zip(ev.pictures, other))
    assert ev.picture_records() == ev_here.picture_records()

    # 2. one check picture shows something else with the same verdict (another passing scene of its prompt): never
    #    paired with this machine's picture, drawn whole and kept in the user's cache
    first = check_indices(len(prompts))[3] * seeds
    cache, _ = entry_with(lambda i, p: rendered([names[i]], [numbers[i] + 1000])[0] if i == first else last_bits(i, p))
    assert scored([rendered([names[first]], [numbers[first] + 1000])[0]], [names[first]],
                  [numbers[first]]).picture_records() == [ev_here.picture_records()[first]]
    asked.clear()
    ev, info = evaluate_kept(cache, identity, sampling, prompts, seeds, 7, draw)
    assert asked == [check_indices(len(prompts)), None] and not info["read"] and info["agreed"] is None
    assert info["note"].startswith("warning: the evaluation cache's entry")
    assert all(np.array_equal(a, b) for a, b in zip(ev.pictures, here))
    assert EvaluationCache(tmp_path / "user").load(key, names, numbers) is not None  # this machine's, kept

    # 3. a check picture whose verdict differs (its object painted out) while most pixels agree: drawn whole
    (tmp_path / "user").rename(tmp_path / "user-before")
    last = check_indices(len(prompts))[-1] * seeds
    blank = np.broadcast_to(np.array([244, 242, 236], dtype=np.uint8), here[0].shape)
    cache, other = entry_with(lambda i, p: np.where(np.abs(p.astype(int) - blank).sum(-1, keepdims=True) > 0,
                                                    blank, p) if i == last else p)
    assert not scored([other[last]], [names[last]], [numbers[last]]).picture_records()[0]["strict"]
    asked.clear()
    ev, info = evaluate_kept(cache, identity, sampling, prompts, seeds, 7, draw)
    assert asked == [check_indices(len(prompts)), None] and not info["read"]
    assert ev.picture_records() == ev_here.picture_records()

    # 4. bitwise equal, as on the machine that drew it
    cache, _ = entry_with(lambda i, p: p)
    asked.clear()
    ev, info = evaluate_kept(cache, identity, sampling, prompts, seeds, 7, draw)
    assert asked == [check_indices(len(prompts))] and info["agreed"] == "bits" and "bitwise equal" in info["note"]



def test_clips_are_kept_as_film_strips_read_back_bitwise_and_from_another_machine_when_their_verdicts_agree(
        tmp_path):
    # the moving-shapes world's clips [T, H, W, 3]: one film-strip cell each, bitwise back; drawn again with other
    # last bits and the same verdicts, read; a clip with its frames reversed (another verdict) is never paired
    from omniroll.tasks.moving_shapes.render import render_prompt

    prompts = ["a red circle moving left", "a square moving up and a triangle moving down",
               "a red circle appears, then a blue square", "a square turning from blue to green"]
    seeds = 3
    order = [(p, eval_seed(7, p, j)) for p in prompts for j in range(seeds)]
    names, numbers = [p for p, _ in order], [s for _, s in order]
    here = [np.ascontiguousarray(render_prompt(p, s).transpose(0, 2, 3, 1)) for p, s in order]  # [T, H, W, 3]
    assert here[0].ndim == 4 and here[0].shape[0] == 9
    ev_here = scored(here, names, numbers, "moving_shapes")
    assert all(r["strict"] for r in ev_here.picture_records())

    cache = EvaluationCache(tmp_path / "own")
    key = entry_key({"weights": "w"}, {}, names, numbers)
    path = cache.store(key, {}, names, numbers, here)
    entry = json.loads((path / "entry.json").read_text())
    h, w = here[0].shape[1:3]
    assert entry["frames"] == 9 and (entry["height"], entry["width"]) == (h, w)
    assert np.asarray(Image.open(path / "pictures.png")).shape == (h, len(here) * 9 * w, 3)  # one row of strips
    back, _ = cache.load(key, names, numbers)
    assert all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(here, back))
    atlas = np.asarray(Image.open(path / "pictures.png")).copy()
    atlas[5, 9 * w + 3 * w + 4, 1] ^= 1  # clip 1, frame 3
    Image.fromarray(atlas).save(path / "pictures.png")
    assert cache.load(key, names, numbers) is None  # its digest sees one level of one frame

    identity, sampling = {"weights": "w", "execution": {"batch_invariant": True}}, {"guidance_scale": 1.0}
    key = entry_key(identity, sampling, names, numbers)

    def draw(indices, n):
        chosen = range(len(prompts)) if indices is None else indices
        idx = [i * seeds + j for i in chosen for j in range(n)]
        return scored([here[k] for k in idx], [names[k] for k in idx], [numbers[k] for k in idx], "moving_shapes")

    def shipped(change):
        root = tmp_path / f"shipped-{len(list(tmp_path.iterdir()))}"
        other = [change(i, c.copy()) for i, c in enumerate(here)]
        EvaluationCache(root).store(key, {}, names, numbers, other)
        return EvaluationCache(tmp_path / f"user-{root.name}", read_only=[root]), other

    def last_bits(i, c):
        step = np.random.default_rng(i).choice([-1] + [0] * 14 + [1], size=c.shape)
        return np.clip(c.astype(int) + step, 0, 255).astype(np.uint8)

    kept, other = shipped(last_bits)
    ev, info = evaluate_kept(kept, identity, sampling, prompts, seeds, 7, draw)
    assert info["read"] and info["agreed"] == "verdicts" and ev.task == "moving_shapes"
    assert all(np.array_equal(a, b) for a, b in zip(ev.pictures, other))
    assert ev.picture_records() == ev_here.picture_records()

    kept, _ = shipped(lambda i, c: c[::-1].copy() if i == 0 else c)  # "moving left" played backwards: moving right
    ev, info = evaluate_kept(kept, identity, sampling, prompts, seeds, 7, draw)
    assert not info["read"] and info["note"].startswith("warning: the evaluation cache's entry")
    assert ev.picture_records() == ev_here.picture_records()

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def lora(engine, zero: bool):
    """A PEFT-wrapped copy of the engine's transformer: a fresh adapter (B = 0) or a moved one."""
    from diffusers import SD3Transformer2DModel

    module = SD3Transformer2DModel.from_config(engine.adapter.denoiser.config)
    module.load_state_dict({k.replace(".base_layer.", "."): v for k, v in engine.adapter.denoiser.state_dict().items()
                            if ".lora_" not in k})
    torch.manual_seed(0)
    wrapped = get_peft_model(module.eval(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    if not zero:
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return wrapped


def test_the_weights_digest_sees_the_weights_a_picture_is_drawn_with(tiny_sd3_path):
    merged = DiffusionEngine.from_pretrained(tiny_sd3_path, merge_lora=True)
    plain = DiffusionEngine.from_pretrained(tiny_sd3_path)
    try:
        base = merged.sample_identity()
        other = plain.sample_identity()
        assert other["weights"] == base["weights"]  # two loads of one checkpoint
        assert {**other, "execution": {**other["execution"], "merge_lora": True}} == base  # merged or not
        assert base["execution"]["batch_invariant"] and base["decode_batch_size"] == 2 and base["device"] == "cpu"
        # a fresh adapter merged changes no weight: the base model's digest, so a run's evaluation before training
        # shares the base model's entry whatever the adapter's random A; unmerged its tensors are read: they count
        WeightSender([merged, plain]).send(lora(merged, zero=True), version=1)
        assert merged.sample_identity()["weights"] == base["weights"]
        assert plain.sample_identity()["weights"] != base["weights"]
        WeightSender([merged]).send(lora(merged, zero=False), version=2)
        assert merged.sample_identity()["weights"] != base["weights"]
        merged.remove_lora(version=3)
        assert merged.sample_identity()["weights"] == base["weights"]
    finally:
        merged.shutdown()
        plain.shutdown()


def trainer_config(train_file, heldout_file, seed, cache=True):
    return load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": "shapes", "max_batch_size": 32, "num_threads": 1, "merge_lora": True},
        "pipeline": {"num_inference_steps": 3},
        "agent": {"num_workers": 1},
        "reward": {"num_workers": 1, "functions": {"geneval": {"fn": "shapes"}}},
        "n": 2, "prompt_length": 12, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"algorithm": "awm", "prompts_file": str(train_file), "prompts_per_step": 2, "lr": 0.003,
                    "micro_batch_size": 4, "steps": 1, "num_threads": 1, "seed": seed,
                    "evaluation": {"splits": [str(train_file), str(heldout_file)], "seeds": 2,
                                   "guidance_scales": [1.0], "cache": cache}},
    })


def test_the_evaluation_before_training_is_read_back_only_when_its_pictures_drawn_again_match(
        ray_cluster, tmp_path, monkeypatch):
    from omniroll.train import Trainer
    from omniroll.train.report.task_eval import TaskEvaluation

    monkeypatch.setenv("OMNIROLL_CACHE_DIR", str(tmp_path / "cache"))
    train, heldout = tmp_path / "train.txt", tmp_path / "heldout.txt"
    train.write_text("a circle\nthree squares\na red circle\n")
    heldout.write_text("two triangles\na blue square\n")

    def run(name, seed):
        lines = []
        with Trainer(trainer_config(train, heldout, seed), str(tmp_path / name), log=lines.append) as tr:
            tr.train()
        records = {s: json.loads((tmp_path / name / "eval" / f"before_{s}_cfg1.json").read_text())
                   for s in ("train", "heldout")}
        return lines, records

    # 1. a first run draws both evaluations and keeps them
    lines, first = run("first", seed=0)
    assert sum("kept in the evaluation cache" in ln for ln in lines) == 2
    entries = {r["cache"]["key"]: s for s, r in first.items()}
    assert not any(r["cache"]["read"] for r in first.values())
    assert sorted(p.name for p in (tmp_path / "cache" / "evaluations").iterdir()) == sorted(entries)

    # 2. the held-out entry made wrong but self-consistent (what a change to the code that draws would leave): its
    #    first picture, which is always drawn again, gets other pixels and their digest
    key = next(k for k, s in entries.items() if s == "heldout")
    folder = tmp_path / "cache" / "evaluations" / key
    atlas = np.asarray(Image.open(folder / "pictures.png")).copy()
    entry = json.loads((folder / "entry.json").read_text())
    h, w = entry["height"], entry["width"]
    atlas[:h, :w] = 255 - atlas[:h, :w]
    Image.fromarray(atlas).save(folder / "pictures.png")
    entry["pictures"][0]["sha256"] = picture_digest(np.ascontiguousarray(atlas[:h, :w]))
    (folder / "entry.json").write_text(json.dumps(entry))

    # 3. another training seed (another random LoRA init: merged with B = 0 it changes no weight): the training
    #    prompts' evaluation is read back (the same verdicts and grid as the run that drew it); the held-out one
    #    fails its check, is drawn whole (the same pictures as the first run's) and replaces the entry
    lines, second = run("second", seed=1)
    assert second["train"]["cache"] == {**first["train"]["cache"], "read": True, "checked": 3, "agreed": "bits",
                                        "note": second["train"]["cache"]["note"]}
    assert sum(ln.strip().startswith("read from the evaluation cache, 3 of its 6 pictures drawn again: bitwise equal")
               for ln in lines) == 1
    assert sum(ln.strip().startswith("warning: the evaluation cache's entry") for ln in lines) == 1
    for split in ("train", "heldout"):
        assert second[split]["pictures"] == first[split]["pictures"]
        assert second[split]["overall"] == first[split]["overall"]
        grids = [(tmp_path / run_name / "eval" / f"before_{split}_cfg1_grid.png").read_bytes()
                 for run_name in ("first", "second")]
        assert grids[0] == grids[1]
    assert second["heldout"]["cache"]["read"] is False and second["heldout"]["cache"]["checked"] == 2
    stored, _ = EvaluationCache(tmp_path / "cache" / "evaluations").load(
        key, [p["prompt"] for p in first["heldout"]["pictures"]], [p["seed"] for p in first["heldout"]["pictures"]])
    assert picture_digest(stored[0]) != entry["pictures"][0]["sha256"]  # replaced

    # 4. `trainer.evaluation.cache: false`: the replicas are not even asked (a handle that is not one would raise)
    off = TaskEvaluation(trainer_config(train, heldout, seed=0, cache=False), str(tmp_path / "off"))
    assert off.kept_identity([object()]) is None
    with pytest.raises(AttributeError, match="sample_identity"):
        TaskEvaluation(trainer_config(train, heldout, seed=0), str(tmp_path / "on")).kept_identity([object()])


def test_omniroll_eval_reads_a_model_as_it_is_from_the_cache_unless_told_not_to(tmp_path, monkeypatch, capsys):
    from omniroll.cli import main

    monkeypatch.setenv("OMNIROLL_CACHE_DIR", str(tmp_path / "cache"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a circle\nthree squares\na red circle\n")
    flags = ["eval", "--model", "shapes", "--prompts", str(prompts), "--seeds", "2", "--steps", "3", "--guidance", "1",
             "--quiet"]

    def run(name, *more):
        capsys.readouterr()
        assert main([*flags, "--out", str(tmp_path / name), *more]) == 0
        return capsys.readouterr().out, json.loads((tmp_path / name / "eval.json").read_text())

    printed, first = run("first")
    assert "drawn, and kept in the evaluation cache" in printed and first["cache"]["read"] is False
    printed, second = run("second")
    assert "read from the evaluation cache, 3 of its 6 pictures drawn again: bitwise equal" in printed
    assert second["cache"] == {**first["cache"], "read": True, "checked": 3, "agreed": "bits",
                              "note": second["cache"]["note"]}
    assert second["pictures"] == first["pictures"] and second["overall"] == first["overall"]
    assert (tmp_path / "first" / "eval_grid.png").read_bytes() == (tmp_path / "second" / "eval_grid.png").read_bytes()
    printed, third = run("third", "--no-cache")
    assert "evaluation cache" not in printed and "cache" not in third and third["pictures"] == first["pictures"]
