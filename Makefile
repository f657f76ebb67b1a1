# omniroll: `make demo` and `make test` work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
VERL_STAMP := $(VENV)/.verl-installed
TRACKING_STAMP := $(VENV)/.tracking-installed
DOCS_STAMP := $(VENV)/.docs-installed
# verl for the integration tests: without its pins (they clash with ours; it is the optional extra omniroll[verl]),
# plus what its imports need. Its wheel ships a top-level `tests` package that would shadow ours: removed.
VERL := verl==0.9.1
VERL_IMPORTS := codetiming orjson cachetools datasets hydra-core aiohttp pyzmq

.PHONY: install demo demo-video shapes-model shapes-model-evaluations shapes-model-distilled shapes-video-model shapes-video-model-evaluations shapes-proxy test test-fast docs docs-generate docs-serve docs-screenshots bench clean

$(PY):
	python3 -m venv $(VENV)

# The ocr extra is in: tests/test_reward_models.py reads rendered text with it (about 10 s, 280 MB: OpenCV 190 MB,
# onnxruntime 80 MB, the PP-OCRv4 models 16 MB). The video extra too (PyAV with its own FFmpeg, about 100 MB
# installed): videos are then written as MP4, and tests/test_video_eval.py reads one back. torch==2.13.0 first: an
# unpinned torch could pull a multi-GB CUDA build on a CPU box.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,ocr,video]"
	touch $(STAMP)

$(VERL_STAMP): $(PY)
	$(PIP) install -q --no-deps $(VERL)
	$(PIP) install -q $(VERL_IMPORTS)
	rm -rf "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tests"
	touch $(VERL_STAMP)

# the trackers tests/test_tracking.py reads back (tensorboard, wandb, mlflow-skinny: ~35 s, ~150 MB)
$(TRACKING_STAMP): $(STAMP) pyproject.toml
	$(PIP) install -q -e ".[tracking]"
	touch $(TRACKING_STAMP)

# the docs site's tools (mkdocs, its Material theme, mkdocstrings; ~5 s, ~30 MB)
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PIP) install -q -e ".[docs]"
	touch $(DOCS_STAMP)

install: $(STAMP)

# The generated pages and regions of docs/ (references, option tables, file map, pictures), rewritten from the code;
# they are committed so that they read on GitHub, and tests/test_docs.py fails when one is stale.
docs-generate: $(STAMP)
	$(PY) docs/hooks/generated.py

# the docs site into site/ (tests/test_docs.py builds it too), or served at http://127.0.0.1:8000 while you edit
docs: docs-generate
	$(VENV)/bin/mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs serve

# Screenshots of three built pages (the home page, a how-to, an algorithm page) in headless Chromium (Debian:
# apt-get install chromium), into docs/screenshots/. The pages' math renders with KaTeX from a CDN: offline it shows
# as LaTeX source.
SHOT_PORT ?= 8765
CHROMIUM ?= chromium
docs-screenshots: docs
	$(PY) -m http.server $(SHOT_PORT) --bind 127.0.0.1 --directory site > /dev/null 2>&1 & echo $$! > .shot-server.pid
	sleep 1
	for page in index:home howto/reward/:howto_reward training/nft/:nft_page; do \
	  $(CHROMIUM) --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
	    --disable-component-update --disable-sync --user-data-dir=$$(mktemp -d) --hide-scrollbars --virtual-time-budget=3000 \
	    --window-size=1280,1500 --screenshot=docs/screenshots/$${page##*:}.png \
	    http://127.0.0.1:$(SHOT_PORT)/$$(echo $${page%%:*} | sed 's/^index$$//') 2> /dev/null; \
	done; kill $$(cat .shot-server.pid); rm -f .shot-server.pid

# The generation demo with the shipped shapes model, then AWM on the shapes world (examples/shapes_demo.yaml, ~5 min
# on 2 cores): the GenEval-style table before and after with the paired verdict, one line per step;
# out/train/ gets metrics.jsonl, eval_curve.png, reward_curve.png, val_before.png / val_after.png (captioned),
# eval/ (tables, grids, before_after_<split>.png, flips_<split>.png), checkpoints/.
demo: $(STAMP)
	$(VENV)/bin/omniroll demo
	$(VENV)/bin/omniroll train --config examples/shapes_demo.yaml --out out/train

# The video demo: AWM on the moving-shapes world with the shipped shapes-video model (examples/shapes_video_demo.yaml);
# 14-20 minutes on 2 cores.
demo-video: $(STAMP)
	$(VENV)/bin/omniroll train --config examples/shapes_video_demo.yaml --out out/train-video

# Retrain the shipped shapes model from scratch (omniroll/models/shapes/recipe.py) and install it over the shipped one.
shapes-model: $(STAMP)
	$(VENV)/bin/omniroll pretrain shapes --out out/shapes-model --install

# The demo's evaluation before training, drawn by the shipped shapes model and kept beside it (its `evaluations/`:
# `make demo` reads it after drawing 8 pictures of each evaluation again and finding them bitwise equal,
# omniroll/evaluation/cache.py). Redraw it after `make shapes-model`. About 4 minutes on 2 cores.
SHAPES_EVALUATIONS = omniroll/models/shapes/checkpoint/evaluations
shapes-model-evaluations: $(STAMP)
	rm -rf $(SHAPES_EVALUATIONS) out/shapes-model-evaluations
	OMNIROLL_CACHE_DIR=out/shapes-model-evaluations/cache $(VENV)/bin/omniroll train --config examples/shapes_demo.yaml \
		--out out/shapes-model-evaluations/run --override trainer.steps=1
	cp -r out/shapes-model-evaluations/cache/evaluations $(SHAPES_EVALUATIONS)

# The video demo's evaluation before training, drawn by the shipped shapes-video model and kept beside it (the same
# rule: `make demo-video` reads it after drawing 8 clips of each evaluation again). Redraw it after
# `make shapes-video-model`.
SHAPES_VIDEO_EVALUATIONS = omniroll/models/shapes_video/checkpoint/evaluations
shapes-video-model-evaluations: $(STAMP)
	rm -rf $(SHAPES_VIDEO_EVALUATIONS) out/shapes-video-model-evaluations
	OMNIROLL_CACHE_DIR=out/shapes-video-model-evaluations/cache $(VENV)/bin/omniroll train \
		--config examples/shapes_video_demo.yaml --out out/shapes-video-model-evaluations/run \
		--override trainer.steps=1
	cp -r out/shapes-video-model-evaluations/cache/evaluations $(SHAPES_VIDEO_EVALUATIONS)

# The shipped shapes model guidance-distilled (omniroll/models/shapes/distill.py): CFG-free, as good as it is at CFG
# 4.5, into out/shapes-distilled/checkpoint (`--model out/shapes-distilled/checkpoint`). About 20 minutes on 2 cores.
shapes-model-distilled: $(STAMP)
	$(VENV)/bin/omniroll pretrain shapes --from shapes --distill 600 --out out/shapes-distilled

# The shapes-video model from scratch (omniroll/models/shapes_video/recipe.py: FULL) into out/shapes-video-model.
# Hours on 2 cores; resumable: run it again after an interruption and it continues (out/shapes-video-model/resume/),
# ending with the bitwise same checkpoint as an uninterrupted run; then installs it as the shipped model
# (omniroll/models/shapes_video/checkpoint/, what --model shapes-video loads).
shapes-video-model: $(STAMP)
	$(VENV)/bin/omniroll pretrain shapes-video --out out/shapes-video-model --install

# Retrain the shapes proxy reward (`fn: shapes_proxy`, omniroll/models/shapes_proxy/) and install it over the shipped
# one: ~1,150 pictures of the shipped shapes model judged by the checker (kept in out/shapes-proxy/generated_*.npz),
# 12,000 rendered examples, a small CNN fitted on them; the agreement with the checker in out/shapes-proxy/weights/
# train.json. About 15-25 minutes on 2 cores.
shapes-proxy: $(STAMP)
	$(VENV)/bin/omniroll pretrain shapes-proxy --out out/shapes-proxy --install

# The suite on TEST_WORKERS processes (pytest-xdist), each test file whole on one of them (`--dist loadfile`: a file's
# tests and module fixtures stay in order, and each worker has its own Ray cluster and model cache). Not `--dist
# loadgroup`: with pytest 9.2 and pytest-xdist 3.8 it does not group (the group suffix xdist adds to a test's id is
# not what pytest reports), so a file's tests were spread over both workers and test_readme.py's pages lost the files
# their earlier blocks wrote (2026-12-02). The docs' blocks are split over three files instead (tests/docs_blocks.py),
# so both workers share them. On the 2-core VM the suite took 18.7 min on 2 workers against 25.4 in one process
# (2026-11-28); TEST_WORKERS=0 runs it in one. More workers than cores buy nothing: on 3 workers it took 21.2 min
# (2026-12-03, against 20.4 on 2 the day before), the CPUs busy 98.6 % of the run (vmstat): the suite is CPU-bound.
TEST_WORKERS ?= 2
test: $(STAMP) $(VERL_STAMP) $(TRACKING_STAMP) $(DOCS_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile

# The inner loop: lint, then every test not marked `slow` (what starts Ray, a server process, a training or CLI
# subprocess or the docs build: tests/conftest.py marks a test from its fixtures, a file that starts its own says so),
# the layer test included, in one process. CONTRIBUTING.md says when to run which.
test-fast: $(STAMP) $(VERL_STAMP) $(TRACKING_STAMP) $(DOCS_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/rollout_throughput.py
	$(PY) benchmarks/prefix_sharing.py
	$(PY) benchmarks/tree_rollout.py
	$(PY) benchmarks/agent_loop_overhead.py
	$(PY) benchmarks/weight_sync.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/lora_merge.py

clean:
	rm -rf $(VENV) .omniroll_cache site
