"""The shapes-video model: a small Wan 2.1 (diffusers' `AutoencoderKLWan`, `WanTransformer3DModel`, a UMT5 text
encoder) trained from scratch on the moving-shapes world (`omniroll.tasks.moving_shapes`), so that a video algorithm
can be judged on a CPU. The saved checkpoint is a plain diffusers `WanPipeline` directory that the Wan adapter loads
with no special path.

`omniroll pretrain shapes-video --out DIR` (`make shapes-video-model`) trains one with the recipe in `recipe.py`,
resumably (`resume.py`: a rerun with the same DIR continues where it stopped and ends bitwise where an uninterrupted
run ends). One file per part: `data.py` (training clips, a pure function of seed and step), `text.py` (the tokenizer
and frozen UMT5), `vae.py` (the video VAE, its decode without the clamp), `dit.py` (the transformer), `recipe.py`,
`resume.py`, `pretrain.py` (the whole run). No trained model ships yet.
"""
