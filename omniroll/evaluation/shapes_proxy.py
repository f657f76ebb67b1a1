"""The shapes proxy's training run (`omniroll.models.shapes_proxy`; `omniroll pretrain shapes-proxy`): the generator's
pictures drawn and judged, the examples, the fit, and its agreement with the checker on held-out generated pictures.

The generator's pictures are drawn by a shapes model at fixed seeds with the evaluation's deterministic ODE, each
judged by the exact checker, and kept in an `.npz` beside the proxy's weights so a second training run reuses them.

`generated_pictures(engine, sampling, prompts, seeds, base_seed)` draws every prompt `seeds` times (the seeds of
`omniroll.evaluation.shapes.eval_seed`, so a base seed other than the evaluation's gives fresh pictures) and returns
{pictures uint8 [N, 64, 64, 3], prompts, seeds, strict}; `kept_or_drawn(path, key, draw)` reads them from `path`
when the file was drawn with the same model, prompts, seeds and steps (`draw_key`), else draws and writes them.
`train_proxy(recipe, out_dir)` is the whole run: it writes the weights (model.safetensors, config.json, SHA256SUMS)
and `train.json` (the recipe, the data's sizes, timings and the agreement) into `out_dir/weights`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np


def open_engine(model: str, steps: int = 10):
    """(an in-process `DiffusionEngine` of `model` on the CPU in fp32, the evaluation's sampling at `steps` ODE
    steps); the caller shuts the engine down."""
    from omniroll.config import load_config
    from omniroll.engine.config import EngineConfig, torch_dtype
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.evaluation.shapes import eval_sampling
    from omniroll.models import load_adapter, resolve_model

    cfg = load_config({"engine": {"model": model, "max_batch_size": 64}})
    kwargs = cfg.engine.engine_kwargs()
    kwargs["dtype"] = torch_dtype(kwargs["dtype"])
    adapter = load_adapter(resolve_model(model), device=kwargs["device"], dtype=kwargs["dtype"])
    return DiffusionEngine(adapter, EngineConfig(**kwargs)), {**eval_sampling(cfg), "num_inference_steps": int(steps)}


def generated_pictures(engine, sampling: dict, prompts: list[str], seeds: int, base_seed: int,
                       progress: bool = False) -> dict:
    """The engine's pictures of every prompt at `seeds` seeds, with the checker's strict verdict of each."""
    from omniroll.evaluation.shapes import evaluate

    ev = evaluate(engine, prompts, seeds, sampling, base_seed, progress=progress)
    return {"pictures": np.stack(ev.pictures).astype(np.uint8), "prompts": list(ev.prompts),
            "seeds": [int(s) for s in ev.seeds], "strict": np.asarray([r.strict for r in ev.rows], dtype=bool)}


def draw_key(model: str, prompts: list[str], seeds: int, base_seed: int, steps: int) -> str:
    """What a kept file of generated pictures must have been drawn with (model directory, prompts, seeds, steps)."""
    from omniroll.models import resolve_model

    what = {"model": os.path.abspath(resolve_model(model)), "prompts": prompts, "seeds": seeds,
            "base_seed": base_seed, "steps": steps}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def kept_or_drawn(path: str, key: str, draw) -> tuple[dict, bool]:
    """(the generated pictures, whether they were read from `path`): read when `path` holds pictures drawn with
    `key` (`draw_key`), else `draw()`n and written there."""
    if os.path.isfile(path):
        with np.load(path, allow_pickle=False) as f:
            if str(f["key"]) == key:
                return {"pictures": f["pictures"], "prompts": [str(p) for p in f["prompts"]],
                        "seeds": [int(s) for s in f["seeds"]], "strict": f["strict"].astype(bool)}, True
    got = draw()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, key=np.asarray(key), pictures=got["pictures"], prompts=np.asarray(got["prompts"]),
                        seeds=np.asarray(got["seeds"]), strict=got["strict"])
    os.replace(tmp, path)
    return got, False


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="it", dynamic_ncols=True, disable=not enabled)


def train_proxy(recipe, out_dir: str, progress: bool = False, log=print) -> dict:
    """The whole run for `recipe` (`ProxyRecipe`): generated pictures (kept in `out_dir/generated_*.npz`), rendered
    and paired examples, the fit, the agreement on the held-out generated set (held-out prompts at
    `heldout_seeds` seeds, training prompts at one seed, all at `heldout_base_seed`: pictures never trained on), the
    files. Returns the record written to `out_dir/weights/train.json`."""
    from omniroll.files import write_json
    from omniroll.models.shapes_proxy.data import paired_examples, rendered_examples
    from omniroll.models.shapes_proxy.train import agreement, fit, predict, save
    from omniroll.tasks.shapes.grammar import all_prompts
    from omniroll.tasks.shapes.splits import prompts_of

    times: dict = {}
    rng = np.random.default_rng(recipe.seed)
    t0 = time.time()
    empty = {"pictures": np.zeros((0, 64, 64, 3), np.uint8), "prompts": [], "seeds": [],
             "strict": np.zeros(0, bool)}
    sets, kept = {}, {}
    train_prompts, heldout_prompts = recipe.prompts(prompts_of("train")), recipe.prompts(prompts_of("heldout"))
    plan = {"train": (train_prompts, recipe.generator_seeds, recipe.generator_base_seed),
            "heldout_prompts": (heldout_prompts, recipe.heldout_seeds, recipe.heldout_base_seed),
            "heldout_fresh_seeds": (train_prompts, 1 if recipe.heldout_seeds else 0, recipe.heldout_base_seed)}
    engine: list = []  # opened on the first set that is not kept

    def draw(prompts, seeds, base):
        if not engine:
            engine.extend(open_engine(recipe.generator, recipe.generator_steps))
        return generated_pictures(engine[0], engine[1], prompts, seeds, base, progress)

    try:
        for name, (prompts, seeds, base) in plan.items():
            if seeds == 0:
                sets[name], kept[name] = empty, False
                continue
            log(f"shapes proxy: {len(prompts) * seeds} pictures of {recipe.generator!r} ({name}: {len(prompts)} "
                f"prompts x {seeds} seeds, base seed {base}, {recipe.generator_steps} steps)")
            key = draw_key(recipe.generator, prompts, seeds, base, recipe.generator_steps)
            sets[name], kept[name] = kept_or_drawn(os.path.join(out_dir, f"generated_{name}.npz"), key,
                                                   lambda: draw(prompts, seeds, base))
    finally:
        if engine:
            engine[0].shutdown()
    times["generate_s"] = time.time() - t0

    t0 = time.time()
    with progress_bar(recipe.rendered, "rendered examples", progress) as bar:
        r_pics, r_prompts, r_labels = rendered_examples(recipe.rendered, all_prompts(), rng, progress=bar.update)
    g = sets["train"]
    if len(g["prompts"]):
        g_pics, g_prompts, g_labels = paired_examples(g["pictures"], g["prompts"], g["strict"], rng)
    else:
        g_pics, g_prompts, g_labels = empty["pictures"], [], empty["strict"]
    times["examples_s"] = time.time() - t0
    pictures = np.concatenate([r_pics, g_pics])
    prompts = r_prompts + g_prompts
    labels = np.concatenate([r_labels, g_labels])
    weights = np.concatenate([np.ones(len(r_labels)), np.full(len(g_labels), recipe.generated_weight)])

    t0 = time.time()
    losses: list[float] = []
    with progress_bar(recipe.steps, "proxy steps", progress) as bar:
        def on_step(step: int, loss: float) -> None:
            losses.append(loss)
            bar.update()
            if step % 50 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")

        net = fit(recipe, pictures, prompts, labels, weights if len(g_labels) else None, on_step)
    times["fit_s"] = time.time() - t0

    t0 = time.time()
    held = {k: sets[k] for k in ("heldout_prompts", "heldout_fresh_seeds")}
    all_pics = np.concatenate([h["pictures"] for h in held.values()])
    all_prompts_ = [p for h in held.values() for p in h["prompts"]]
    all_strict = np.concatenate([h["strict"] for h in held.values()])
    measured: dict = {}
    if len(all_prompts_):
        probs = predict(net, all_pics, all_prompts_)
        measured["heldout_generated"] = agreement(probs, all_strict, all_prompts_)
        start = 0
        for k, h in held.items():
            n = len(h["prompts"])
            measured[k] = agreement(probs[start:start + n], h["strict"], h["prompts"])
            start += n
        mism = paired_examples(all_pics, all_prompts_, all_strict, np.random.default_rng(recipe.seed + 1),
                               near_per_picture=1, other_per_picture=0, perturbed_per_picture=0)
        mine = np.arange(len(mism[1])) % 2 == 1  # the near-prompt pairings only
        measured["heldout_generated_near_prompt"] = agreement(predict(net, mism[0][mine], list(np.asarray(
            mism[1])[mine])), mism[2][mine], list(np.asarray(mism[1])[mine]))
    measured["training_examples"] = agreement(predict(net, pictures, prompts), labels, prompts)
    times["measure_s"] = time.time() - t0
    weights_dir = save(net, recipe, os.path.join(out_dir, "weights"))
    record = {"recipe": recipe.to_dict(), "times": times,
              "data": {"rendered": len(r_labels), "rendered_pass_rate": float(np.mean(r_labels)) if len(r_labels)
                       else None, "generated_train_pictures": len(g["prompts"]), "generated_examples": len(g_labels),
                       "generated_pass_rate": float(np.mean(g["strict"])) if len(g["prompts"]) else None,
                       "heldout_generated_pictures": len(all_prompts_), "kept": kept},
              "final_loss": float(np.mean(losses[-100:])), "agreement": measured,
              "parameters": int(sum(p.numel() for p in net.parameters()))}
    from omniroll.models.shipped import write_sums

    write_json(os.path.join(weights_dir, "train.json"), record)
    write_sums(weights_dir)
    return record
