"""The tracker backends of `omniroll.train.report.tracking`, one class each, each importing its library only when built.

Every backend has `run_id`, `log_scalars(values, step)`, `log_histogram(key, values, step)`,
`log_media(key, items, step, fps)` (items: (uint8 HWC image or THWC video, caption)) and `close()`.

Where each writes (verl's environment variables where verl has one):
- tensorboard: `$TENSORBOARD_DIR`, else `<out>/tensorboard/<experiment>`; a resumed run purges events after the
  checkpoint's step. TensorBoard has no captions: the caption is drawn under the image; videos are animated GIFs.
- wandb: `wandb.init(project, name=experiment, id, resume="allow")` under `$WANDB_DIR`, else `<out>`; `WANDB_MODE`
  (e.g. offline) is wandb's own.
- mlflow: `$MLFLOW_TRACKING_URI`, else the file store `<out>/mlruns` (mlflow 3 keeps file stores behind
  `MLFLOW_ALLOW_FILE_STORE=true`, which is set for a file store unless already set). Experiment = project, run name =
  experiment. Images with their captions drawn in (and `captions/<key>/step_N.json`), the histogram as
  `histograms/<key>/step_N.json`, videos as GIF artifacts.
- swanlab: `SWANLAB_MODE` (cloud, local, offline, disabled), `$SWANLAB_LOG_DIR`, else `<out>/swanlog`. swanlab has no
  histogram type: the reward histogram is not sent there.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class RunInfo:
    project: str
    experiment: str
    out_dir: str
    config: dict
    resume_step: int = 0  # > 0: continuing a run from the checkpoint of this step


def captioned(image: np.ndarray, caption: str, min_width: int = 256) -> np.ndarray:
    """An HWC uint8 image upscaled (nearest) to at least `min_width` pixels wide, the caption drawn under it."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.fromarray(image)
    scale = max(1, -(-min_width // img.width))
    img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    font = ImageFont.load_default()
    per_line = max(8, img.width // 7)
    lines = [caption[i:i + per_line] for i in range(0, len(caption), per_line)][:4] or [""]
    band = 4 + 14 * len(lines)
    canvas = Image.new("RGB", (img.width, img.height + band), "white")
    canvas.paste(img, (0, 0))
    draw = ImageDraw.Draw(canvas)
    for j, line in enumerate(lines):
        draw.text((3, img.height + 2 + 14 * j), line, fill="black", font=font)
    return np.asarray(canvas)


def gif_bytes(frames: np.ndarray, fps: int) -> bytes:
    """THWC uint8 frames -> an animated GIF."""
    from PIL import Image

    imgs = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    imgs[0].save(buf, format="GIF", save_all=True, append_images=imgs[1:], duration=max(1, 1000 // max(fps, 1)),
                 loop=0)
    return buf.getvalue()


def _gif_file(frames: np.ndarray, fps: int, directory: str, name: str) -> str:
    """The GIF handed to a tracker: `<out>/.tracking_media/<backend>/<key>_step<N>_<i>.gif` (kept: a tracker may
    copy it late)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name.replace("/", "_") + ".gif")
    with open(path, "wb") as f:
        f.write(gif_bytes(frames, fps))
    return path


def _native_media(key: str, step: int, items: list, fps: int, media_dir: str, image, video) -> list:
    """(pixels, caption) items as a tracker's own captioned objects: `image(HWC, caption=)`, `video(gif path,
    caption=)` (a video is written to a GIF under `media_dir` first)."""
    out = []
    for i, (px, caption) in enumerate(items):
        if px.ndim == 3:
            out.append(image(px, caption=caption))
        else:
            out.append(video(_gif_file(px, fps, media_dir, f"{key}_step{step:06d}_{i}"), caption=caption))
    return out


class TensorBoardBackend:
    def __init__(self, info: RunInfo, run_id: Optional[str] = None):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = os.environ.get("TENSORBOARD_DIR") or os.path.join(info.out_dir, "tensorboard", info.experiment)
        self.writer = SummaryWriter(self.logdir, purge_step=info.resume_step + 1 if info.resume_step else None)
        self.run_id = self.logdir
        if not info.resume_step:
            import json

            self.writer.add_text("config", "```\n" + json.dumps(info.config, indent=1) + "\n```", 0)

    def log_scalars(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def log_histogram(self, key: str, values: np.ndarray, step: int) -> None:
        self.writer.add_histogram(key, values, step)

    def log_media(self, key: str, items: list, step: int, fps: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        for i, (px, caption) in enumerate(items):
            if px.ndim == 3:
                self.writer.add_image(f"{key}/{i}", captioned(px, caption), step, dataformats="HWC")
            else:  # a video: an animated GIF in the image dashboard (what add_video writes, without moviepy)
                frames = np.stack([captioned(f, caption) for f in px])
                t, h, w, c = frames.shape
                img = Summary.Image(height=h, width=w, colorspace=c, encoded_image_string=gif_bytes(frames, fps))
                self.writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=f"{key}/{i}", image=img)]), step)
        self.writer.add_text(f"{key}/captions", "\n\n".join(f"{i}: {c}" for i, (_, c) in enumerate(items)), step)

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    def __init__(self, info: RunInfo, run_id: Optional[str] = None):
        import wandb

        self.wandb = wandb
        self.media_dir = os.path.join(info.out_dir, ".tracking_media", "wandb")
        directory = os.environ.get("WANDB_DIR") or info.out_dir
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=info.project, name=info.experiment, id=run_id, resume="allow", dir=directory,
                              config=info.config, reinit="create_new")
        self.run_id = self.run.id

    def log_scalars(self, values: dict, step: int) -> None:
        self.run.log(dict(values), step=step)

    def log_histogram(self, key: str, values: np.ndarray, step: int) -> None:
        self.run.log({key: self.wandb.Histogram(np.asarray(values, dtype=np.float64))}, step=step)

    def log_media(self, key: str, items: list, step: int, fps: int) -> None:
        video = lambda path, caption: self.wandb.Video(path, caption=caption, format="gif")  # noqa: E731
        self.run.log({key: _native_media(key, step, items, fps, self.media_dir, self.wandb.Image, video)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowBackend:
    def __init__(self, info: RunInfo, run_id: Optional[str] = None):
        uri = os.environ.get("MLFLOW_TRACKING_URI") or "file:" + os.path.abspath(os.path.join(info.out_dir, "mlruns"))
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient

        self.media_dir = os.path.join(info.out_dir, ".tracking_media", "mlflow")
        self.client = MlflowClient(uri)
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
        else:
            exp = self.client.get_experiment_by_name(info.project)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(info.project)
            self.run_id = self.client.create_run(exp_id, run_name=info.experiment).info.run_id
            self.client.log_dict(self.run_id, info.config, "config.json")

    def log_scalars(self, values: dict, step: int) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, step) for k, v in values.items()])

    def log_histogram(self, key: str, values: np.ndarray, step: int) -> None:
        values = np.asarray(values, dtype=np.float64)
        counts, edges = np.histogram(values, bins=min(32, max(1, len(values))))
        self.client.log_dict(self.run_id, {"step": step, "counts": counts.tolist(), "bin_edges": edges.tolist(),
                                           "values": values.tolist()}, f"histograms/{key}/step_{step:06d}.json")

    def log_media(self, key: str, items: list, step: int, fps: int) -> None:
        for i, (px, caption) in enumerate(items):
            if px.ndim == 3:
                self.client.log_image(self.run_id, captioned(px, caption), key=f"{key}/{i}", step=step)
            else:
                path = _gif_file(np.stack([captioned(f, caption) for f in px]), fps, self.media_dir,
                                 f"{key}_step{step:06d}_{i}")
                self.client.log_artifact(self.run_id, path, f"videos/{key}/step_{step:06d}")
        self.client.log_dict(self.run_id, {"step": step, "captions": [c for _, c in items]},
                             f"captions/{key}/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class SwanlabBackend:
    def __init__(self, info: RunInfo, run_id: Optional[str] = None):
        import swanlab

        self.swanlab = swanlab
        self.media_dir = os.path.join(info.out_dir, ".tracking_media", "swanlab")
        kw = {"project": info.project, "name": info.experiment, "config": info.config,
              "log_dir": os.environ.get("SWANLAB_LOG_DIR") or os.path.join(info.out_dir, "swanlog")}
        if os.environ.get("SWANLAB_MODE"):
            kw["mode"] = os.environ["SWANLAB_MODE"]
        if run_id:
            kw.update(id=run_id, resume="allow")
        os.makedirs(kw["log_dir"], exist_ok=True)
        self.run = swanlab.init(**kw)
        self.run_id = self.run.id

    def log_scalars(self, values: dict, step: int) -> None:
        self.run.log(dict(values), step=step)

    def log_histogram(self, key: str, values: np.ndarray, step: int) -> None:
        pass  # swanlab has no histogram type

    def log_media(self, key: str, items: list, step: int, fps: int) -> None:
        media = _native_media(key, step, items, fps, self.media_dir, self.swanlab.Image,
                              self.swanlab.Video)
        self.run.log({key: media}, step=step)

    def close(self) -> None:
        self.run.finish()


BACKENDS = {"tensorboard": TensorBoardBackend, "wandb": WandbBackend, "mlflow": MlflowBackend,
            "swanlab": SwanlabBackend}
