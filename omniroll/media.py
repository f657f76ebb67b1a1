"""Writing generated samples to disk: PNG images, and video as MP4 (PyAV, when installed) or else animated WebP
(Pillow), plus a PNG strip of the frames; `read_video` reads either back.

`omniroll generate` and `run_rollout` (`omniroll rollout`) use these; the format actually written is returned (and
reported by the commands), never silently substituted. A leaf module: it imports no omniroll package but `errors`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from omniroll.errors import OutputWriteError


def video_encoder() -> str:
    """"mp4" when PyAV (`pip install av`, the `video` extra) can encode H.264, else "webp" (animated, Pillow)."""
    try:
        import av

        av.codec.Codec("libx264", "w")
        return "mp4"
    except Exception:  # noqa: BLE001 - not installed, or built without an H.264 encoder
        return "webp"


def save_image(image: torch.Tensor, path: Path) -> Path:
    """uint8 [3, H, W] -> PNG."""
    from PIL import Image

    return _save(path, lambda: Image.fromarray(image.permute(1, 2, 0).contiguous().numpy()).save(path))


def save_strip(frames: torch.Tensor, path: Path) -> Path:
    """uint8 [N, 3, H, W] (frames of a video, or samples) -> one PNG row, left to right."""
    from PIL import Image

    grid = frames.permute(2, 0, 3, 1).reshape(frames.shape[2], -1, 3).contiguous().numpy()  # H, N*W, 3
    return _save(path, lambda: Image.fromarray(grid).save(path))


def _save(path: Path, write) -> Path:
    """Run `write()`, which writes `path`. A failure to write (disk full, file too large, ...) removes what it left
    and raises `OutputWriteError` naming the file, as `omniroll.files.write_bytes` does."""
    try:
        write()
    except OSError as e:
        Path(path).unlink(missing_ok=True)
        raise OutputWriteError(str(path), e) from e
    return path


def save_video(frames: torch.Tensor, stem: Path, fps: int) -> Path:
    """uint8 [T, 3, H, W] -> `stem`.mp4 (H.264, yuv420p; PyAV) or, without an encoder, `stem`.webp (animated,
    lossless). Returns the path written."""
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"frames must be uint8 [T, 3, H, W], got {frames.dtype} {tuple(frames.shape)}")
    hwc = [np.ascontiguousarray(f.permute(1, 2, 0).numpy()) for f in frames]
    if video_encoder() == "mp4":
        import av

        path = stem.with_suffix(".mp4")
        return _save(path, lambda: _encode_mp4(av, path, hwc, fps))
    from PIL import Image

    path = stem.with_suffix(".webp")
    images = [Image.fromarray(img) for img in hwc]
    return _save(path, lambda: images[0].save(path, save_all=True, append_images=images[1:],
                                              duration=max(1, round(1000 / fps)), loop=0, lossless=True))


def _encode_mp4(av, path: Path, hwc: list, fps: int) -> None:
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=int(fps))
        # yuv420p needs even sizes: pad by one row / column (edge pixels) where needed
        h, w = hwc[0].shape[:2]
        stream.height, stream.width, stream.pix_fmt = h + h % 2, w + w % 2, "yuv420p"
        for img in hwc:
            img = np.pad(img, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge")
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def read_video(path: Path) -> torch.Tensor:
    """The frames of a video `save_video` wrote, uint8 [T, 3, H, W]: an MP4 (decoded with PyAV; lossy, so near the
    frames written, not equal) or an animated WebP (lossless: the frames written)."""
    path = Path(path)
    if path.suffix == ".mp4":
        import av

        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    else:
        from PIL import Image, ImageSequence

        with Image.open(path) as im:
            frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)]
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()


def save_sample(pixels: torch.Tensor, stem: Path, fps: int = 16) -> list[Path]:
    """One sample: an image [3, H, W] -> `stem`.png; a video [T, 3, H, W] -> the video plus `stem`_frames.png."""
    if pixels.ndim == 3:
        return [save_image(pixels, stem.with_suffix(".png"))]
    return [save_video(pixels, stem, fps), save_strip(pixels, stem.parent / f"{stem.name}_frames.png")]
