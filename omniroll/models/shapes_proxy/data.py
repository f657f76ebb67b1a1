"""The shapes proxy's training examples: (picture, prompt, the exact checker's strict verdict) triples made from the
world, and from a generator's pictures when they are given.

`rendered_examples` renders scenes and pairs each with a prompt by one of five kinds (`KINDS`): its own prompt (a
pass), a near prompt (same category, one word changed: mostly a fail the picture nearly meets), any other prompt, its
own prompt with one object removed or recoloured, or its own prompt under a perturbation (noise, blur, a colour cast,
a patch painted over). `paired_examples` pairs given pictures (a generator's) with their own prompt, near prompts and
other prompts. Every label is the checker's verdict on the pair, never the kind's guess.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from omniroll.tasks.shapes.grammar import all_prompts, parse_prompt
from omniroll.tasks.shapes.render import render
from omniroll.tasks.shapes.report import score_picture
from omniroll.tasks.shapes.scene import Scene, sample_scene
from omniroll.tasks.shapes.world import DEFAULT_WORLD

#: how a rendered picture is paired with its prompt, and the share of each
KINDS = {"own": 0.2, "near": 0.3, "other": 0.1, "edited": 0.2, "perturbed": 0.2}


def near_prompts(prompts: list[str]) -> dict[str, list[str]]:
    """prompt -> the grammar's prompts of the same category and length that differ from it in one word (or are its
    words in another order)."""
    everything = all_prompts()
    by_shape: dict[tuple, list[tuple[str, ...]]] = {}
    for q in everything:
        spec = parse_prompt(q)
        by_shape.setdefault((spec.tag, len(q.split())), []).append(tuple(q.split()))
    out = {}
    for p in prompts:
        spec = parse_prompt(p)
        w = tuple(spec.prompt.split())
        same = by_shape[(spec.tag, len(w))]
        out[p] = [" ".join(q) for q in same
                  if q != w and (sum(a != b for a, b in zip(q, w)) == 1 or sorted(q) == sorted(w))]
    return out


def perturb(picture: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One random perturbation of a uint8 [H, W, 3] picture: noise, a blur, a colour cast, or a patch painted with
    the background."""
    x = picture.astype(np.float32)
    kind = rng.integers(4)
    if kind == 0:
        x = x + rng.normal(0, rng.uniform(4, 40), x.shape)
    elif kind == 1:
        k = int(rng.integers(1, 3))
        x = sum(np.roll(np.roll(x, dy, 0), dx, 1) for dy in range(-k, k + 1) for dx in range(-k, k + 1))
        x = x / (2 * k + 1) ** 2
    elif kind == 2:
        x = x + rng.uniform(-50, 50, 3)
    else:
        h, w = int(rng.integers(6, 24)), int(rng.integers(6, 24))
        y0, x0 = int(rng.integers(0, x.shape[0] - h)), int(rng.integers(0, x.shape[1] - w))
        x[y0:y0 + h, x0:x0 + w] = DEFAULT_WORLD.background
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def edited(scene: Scene, rng: np.random.Generator) -> Scene:
    """The scene with one object removed (when it has more than one) or given another shape or colour."""
    objects = list(scene.objects)
    i = int(rng.integers(len(objects)))
    if len(objects) > 1 and rng.random() < 0.5:
        del objects[i]
    elif rng.random() < 0.5:
        objects[i] = dataclasses.replace(objects[i], shape=str(rng.choice(DEFAULT_WORLD.shapes)))
    else:
        objects[i] = dataclasses.replace(objects[i], colour=str(rng.choice(list(DEFAULT_WORLD.colours))))
    return Scene(tuple(objects))


def rendered_examples(n: int, prompts: list[str], rng: np.random.Generator,
                      progress=None) -> tuple[np.ndarray, list[str], np.ndarray]:
    """`n` examples (pictures uint8 [n, 64, 64, 3], prompts, strict verdicts bool [n]) over `prompts`, of the kinds
    in `KINDS`; `progress` (a callable) is called once per example."""
    near = near_prompts(prompts)
    everything = all_prompts()
    kinds, shares = list(KINDS), np.asarray(list(KINDS.values()))
    pictures, chosen, labels = np.empty((n, 64, 64, 3), np.uint8), [], np.empty(n, bool)
    for i in range(n):
        p = prompts[int(rng.integers(len(prompts)))]
        spec = parse_prompt(p)
        kind = kinds[int(rng.choice(len(kinds), p=shares / shares.sum()))]
        drawn = spec
        if kind == "near" and near[p]:
            drawn = parse_prompt(near[p][int(rng.integers(len(near[p])))])
        elif kind in ("near", "other"):
            drawn = parse_prompt(everything[int(rng.integers(len(everything)))])
        scene = sample_scene(drawn, rng)
        picture = render(edited(scene, rng) if kind == "edited" else scene)
        if kind == "perturbed":
            picture = perturb(picture, rng)
        pictures[i] = picture
        chosen.append(spec.prompt)
        labels[i] = score_picture(spec, picture).strict
        if progress is not None:
            progress()
    return pictures, chosen, labels


def paired_examples(pictures: np.ndarray, prompts: list[str], strict: np.ndarray, rng: np.random.Generator,
                    near_per_picture: int = 2, other_per_picture: int = 1,
                    perturbed_per_picture: int = 1) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Given pictures with their prompts and verdicts: each with its own prompt (its given verdict), with
    `near_per_picture` near prompts and `other_per_picture` other prompts, and `perturbed_per_picture` perturbed
    copies under its own prompt (those judged by the checker)."""
    near = near_prompts(sorted(set(prompts)))
    everything = all_prompts()
    out_pics, out_prompts, out_labels = [], [], []
    for pic, p, ok in zip(pictures, prompts, strict):
        out_pics.append(pic)
        out_prompts.append(p)
        out_labels.append(bool(ok))
        pool = near[p] or everything
        others = [pool[int(rng.integers(len(pool)))] for _ in range(near_per_picture)]
        others += [everything[int(rng.integers(len(everything)))] for _ in range(other_per_picture)]
        for q in others:
            out_pics.append(pic)
            out_prompts.append(q)
            out_labels.append(bool(score_picture(parse_prompt(q), pic).strict))
        for _ in range(perturbed_per_picture):
            bent = perturb(pic, rng)
            out_pics.append(bent)
            out_prompts.append(p)
            out_labels.append(bool(score_picture(parse_prompt(p), bent).strict))
    return np.stack(out_pics), out_prompts, np.asarray(out_labels, bool)
